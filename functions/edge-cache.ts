/**
 * Hits served from the Worker's own memory. A recorded output never changes
 * (invariant 3), so once the task graph has answered a hit, or has recorded a
 * new node through this isolate, this isolate may answer the same result id
 * again without asking it. Authorization is still checked on every request,
 * before this cache is read. `EDGE_CACHE_BYTES` bounds it; 0 turns it off.
 *
 * An entry lives at most {@link EDGE_TTL_MS}, and less than half of
 * `IDLE_TASK_TTL_MS`. Every entry is made by a graph hit or a record, both
 * uses of the task, and a task is deleted for being idle only when its last
 * use is older than `IDLE_TASK_TTL_MS`: so no isolate still answers for a
 * deleted task. A node evicted from its graph for budgets can still be
 * answered here until its entry expires.
 *
 * It also keeps the text of each lookup body it answered with a hit, and the
 * result id that body names. Parsing, validating and hashing a body are
 * functions of its text alone, so the same text again (a group's rollouts
 * send the same history, or cursor, and call) goes straight to its entry.
 * On a hit those three were a large share of the Worker's work beyond the
 * runtime's own.
 *
 * The task graph still counts these hits: they are batched per task and sent
 * off the hot path, at most FLUSH_MS after the first hit of a batch, so its
 * stats lag by about that. An isolate that is torn down loses its unsent
 * counts (at most one batch).
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

/** The longest an isolate answers a hit without asking its task graph. */
export const EDGE_TTL_MS = 3_600_000;

/** A hit as it is answered: its JSON, serialized once, and what counting it needs. */
interface Entry {
	json: string;
	tool: string;
	execMs: number;
	/** When this isolate stops answering it (core/clock.ts time). */
	expires: number;
}

/** A lookup body answered with a hit: the result id it names. */
interface Seen {
	id: string;
}

/** The longest lookup body kept; a longer one is parsed every time. */
export const SEEN_MAX_CHARS = 16 << 10;

let cache: LRUCache<string, Entry | Seen> | null = null;

const WIDE = /[^\u0000-\u00ff]/;
/**
 * What an entry's string takes in memory, and a fixed overhead. V8 keeps a
 * string whose characters are all Latin-1 at one byte each (most JSON),
 * and any other at two. Measured once, when the entry is stored.
 */
const entrySize = (text: string) =>
	text.length * (WIDE.test(text) ? 2 : 1) + 256;

/** The isolate's cache, or null when `EDGE_CACHE_BYTES` is 0. */
function store(env: Env): LRUCache<string, Entry | Seen> | null {
	const maxSize = Number(env.EDGE_CACHE_BYTES);
	if (!(maxSize > 0)) return null;
	// One size per deployment; a different one (a test's) starts afresh.
	if (cache?.maxSize !== maxSize)
		cache = new LRUCache<string, Entry | Seen>({
			maxSize,
			// A hit's size is its JSON's; a body's, its text's (the key).
			sizeCalculation: (e, key) => entrySize("json" in e ? e.json : key),
		});
	return cache;
}

/**
 * A hit's key. A body's key is its text as it came: only valid JSON is kept,
 * and JSON never holds the raw NUL that every hit's key does. (No prefix:
 * it would copy each lookup's text to look it up.)
 */
const cacheKey = (scope: Scope, id: string) =>
	`${scope.project}\u0000${scope.task}\u0000${id}`;

/**
 * The result id that lookup body `text` names, if this isolate answered it
 * with a hit before: the body was valid then, and is the same text now.
 */
export function seenLookup(env: Env, text: string): string | undefined {
	const e = store(env)?.get(text);
	return e && !("json" in e) ? e.id : undefined;
}

/** Remembers that lookup body `text`, answered with a hit, names result `id`. */
export function rememberLookup(env: Env, text: string, id: string): void {
	if (text.length > SEEN_MAX_CHARS) return;
	store(env)?.set(text, { id }, { size: entrySize(text) });
}

export function cachedHit(
	env: Env,
	scope: Scope,
	id: string,
): Entry | undefined {
	const s = store(env);
	const key = cacheKey(scope, id);
	const e = s?.get(key);
	if (!e || !("json" in e)) return undefined;
	if (e.expires <= now()) {
		s!.delete(key);
		return undefined;
	}
	return e;
}

/** Keeps a hit for this isolate to answer again; returns its JSON. */
export function rememberHit(
	env: Env,
	scope: Scope,
	tool: string,
	hit: Hit,
): string {
	const json = JSON.stringify(hit);
	keep(env, scope, tool, hit, json);
	return json;
}

/**
 * Keeps a hit that a record has just created, for its first lookup. Nothing
 * answers with it now, so an output too large to keep is never serialized.
 */
export function rememberRecorded(
	env: Env,
	scope: Scope,
	tool: string,
	hit: Hit,
): void {
	const s = store(env);
	// The JSON is longer than the output alone, which takes a byte a character at least.
	if (s && hit.output.length + 256 <= s.maxSize / 16)
		keep(env, scope, tool, hit, JSON.stringify(hit));
}

function keep(
	env: Env,
	scope: Scope,
	tool: string,
	hit: Hit,
	json: string,
): void {
	const s = store(env);
	// One output never takes more than a sixteenth of the cache.
	if (!s || json.length + 256 > s.maxSize / 16) return;
	const size = entrySize(json);
	if (size > s.maxSize / 16) return;
	const ttl = Math.min(EDGE_TTL_MS, Number(env.IDLE_TASK_TTL_MS) / 2);
	s.set(
		cacheKey(scope, hit.id),
		{
			json,
			tool,
			execMs: hit.execMs,
			expires: now() + ttl,
		},
		{ size },
	);
}

interface Pending {
	scope: Scope;
	hits: EdgeHit[];
	since: number;
}
const pending = new Map<string, Pending>();
const pendingKey = (s: Scope) => `${s.project}\u0000${s.task}`;

/**
 * Counts an edge hit. Returns the work that sends hits to the task graph,
 * for the caller's `waitUntil` (the response never waits for it), or null.
 * The first hit of a batch schedules it to be sent FLUSH_MS later, so its
 * counts never wait for more traffic; a full batch is sent at once, and so
 * is one older than FLUSH_MS (its timer ended with a request the runtime
 * cut short). `graph` names the task's stub, only then.
 */
export function countEdgeHit(
	scope: Scope,
	hit: EdgeHit,
	graph: () => DurableObjectStub<TaskGraph>,
): Promise<void> | null {
	const k = pendingKey(scope);
	let p = pending.get(k);
	const opened = p === undefined;
	if (!p) {
		p = { scope, hits: [], since: now() };
		pending.set(k, p);
	}
	p.hits.push(hit);
	if (p.hits.length >= FLUSH_COUNT || now() - p.since >= FLUSH_MS) {
		pending.delete(k);
		return sendPending(graph(), p);
	}
	return opened ? sendWhenDue(graph(), p) : null;
}

/** Sends batch `p` FLUSH_MS from now, unless it was sent or taken meanwhile. */
async function sendWhenDue(
	graph: DurableObjectStub<TaskGraph>,
	p: Pending,
): Promise<void> {
	await new Promise((resolve) => setTimeout(resolve, FLUSH_MS));
	const k = pendingKey(p.scope);
	if (pending.get(k) !== p) return;
	pending.delete(k);
	await sendPending(graph, p);
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
