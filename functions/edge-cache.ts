/**
 * Hits served from the Worker's own memory. A recorded output never changes
 * (invariant 3), so once the task graph has answered a hit, this isolate may
 * answer the same result id again without asking it. Authorization is still
 * checked on every request, before this cache is read.
 *
 * The task graph still counts these hits: they are batched per task and sent
 * off the hot path, so its stats lag by at most FLUSH_MS while traffic flows.
 * An isolate that is torn down loses its unsent counts (at most one batch).
 */
import { LRUCache } from "lru-cache";
import type { Hit } from "../core/api.ts";
import { now } from "../core/clock.ts";
import type {
	EdgeHit,
	Scope,
	TaskGraph,
} from "../durable-objects/task-graph.ts";

const FLUSH_MS = 1000;
const FLUSH_COUNT = 64;

/** A hit as it is answered: its JSON, serialized once, and what counting it needs. */
interface Entry {
	json: string;
	tool: string;
	execMs: number;
}

let cache: LRUCache<string, Entry> | null = null;

function store(env: Env): LRUCache<string, Entry> {
	cache ??= new LRUCache<string, Entry>({
		maxSize: Number(env.EDGE_CACHE_BYTES),
		// JavaScript strings take two bytes a code unit; the rest is overhead.
		sizeCalculation: (e) => e.json.length * 2 + 256,
	});
	return cache;
}

const cacheKey = (scope: Scope, id: string) =>
	`${scope.project}\u0000${scope.task}\u0000${id}`;

export function cachedHit(
	env: Env,
	scope: Scope,
	id: string,
): Entry | undefined {
	return store(env).get(cacheKey(scope, id));
}

/** Keeps a hit for this isolate to answer again; returns its JSON. */
export function rememberHit(
	env: Env,
	scope: Scope,
	tool: string,
	hit: Hit,
): string {
	const json = JSON.stringify(hit);
	const maxSize = Number(env.EDGE_CACHE_BYTES);
	if (json.length * 2 + 256 <= maxSize / 16)
		store(env).set(cacheKey(scope, hit.id), {
			json,
			tool,
			execMs: hit.execMs,
		});
	return json;
}

interface Pending {
	scope: Scope;
	hits: EdgeHit[];
	since: number;
}
const pending = new Map<string, Pending>();
const pendingKey = (s: Scope) => `${s.project}\u0000${s.task}`;

/**
 * Counts an edge hit; returns a batch to send when one is due. The caller
 * sends it with `waitUntil`, so the response does not wait for it.
 */
export function countEdgeHit(scope: Scope, hit: EdgeHit): Pending | null {
	const k = pendingKey(scope);
	let p = pending.get(k);
	if (!p) {
		p = { scope, hits: [], since: now() };
		pending.set(k, p);
	}
	p.hits.push(hit);
	if (p.hits.length >= FLUSH_COUNT || now() - p.since >= FLUSH_MS) {
		pending.delete(k);
		return p;
	}
	return null;
}

/** Takes the unsent hits of a task (stats reads send them first). */
export function takePending(scope: Scope): Pending | null {
	const k = pendingKey(scope);
	const p = pending.get(k) ?? null;
	pending.delete(k);
	return p;
}

export async function sendPending(
	graph: DurableObjectStub<TaskGraph>,
	p: Pending | null,
): Promise<void> {
	if (p && p.hits.length > 0) await graph.countHits(p.scope, p.hits);
}
