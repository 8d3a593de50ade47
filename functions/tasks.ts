/**
 * The cache itself, per task: lookup, record, results by id, leases, stats
 * and the graph export. The task graph Durable Object is named here, from the
 * authenticated project and the task in the path, never from the client.
 */
import { Hono, type Context } from "hono";
import {
	EvictionLogQuery,
	GraphQuery,
	Id,
	LeaseRequest,
	LIMITS,
	LookupRequest,
	RecordRequest,
	RenewRequest,
	TaskListQuery,
	type Hit,
	type LookupResponse,
	type Miss,
	type TaskInfo,
	type TaskPage,
} from "../core/api.ts";
import {
	callKey,
	childId,
	mutates,
	obsId,
	pathIds,
	ROOT_ID,
} from "../core/ids.ts";
import type { Result } from "../core/result.ts";
import type { StoredHit } from "../durable-objects/task-graph.ts";
import type { AppEnv } from "./app.ts";
import { allow, graph, taskScope as task } from "./auth.ts";
import {
	cachedHit,
	countEdgeHit,
	rememberHit,
	rememberLookup,
	rememberRecorded,
	seenLookup,
	sendPending,
	takePending,
} from "./edge-cache.ts";
import { budgetsFor, quotaError } from "./budgets.ts";
import { checkSnapshots } from "./snapshots.ts";
import { apiError, unwrap } from "./errors.ts";
import { jsonBody, jsonText, parseJson, valid } from "./validate.ts";

export const tasks = new Hono<AppEnv>();

const trainer = allow(["trainer", "admin"]);

function leaseTtl(env: Env, ttlMs: number | undefined): number {
	return Math.min(
		ttlMs ?? Number(env.LEASE_TTL_MS),
		Number(env.LEASE_MAX_TTL_MS),
	);
}

/** A hit with its output, fetching a large one from R2. */
async function materialize(env: Env, h: StoredHit): Promise<Hit> {
	let output = h.output;
	if (output === null) {
		const blob = await env.BLOBS.get(h.outputKey!);
		if (!blob) throw new Error(`output blob ${h.outputKey} is missing`);
		output = await blob.text();
	}
	return {
		status: "hit",
		tier: "exact",
		id: h.id,
		state: h.state,
		output,
		exitCode: h.exitCode,
		execMs: h.execMs,
	};
}

/** `Server-Timing`: where the request went (edge or graph), and the total. */
function timing(
	start: number,
	part: { edge: number } | { graph: number },
): string {
	const [name, ms] =
		"edge" in part ? ["edge", part.edge] : ["graph", part.graph];
	const total = performance.now() - start;
	return `${name};dur=${ms.toFixed(2)}, total;dur=${total.toFixed(2)}`;
}

/**
 * A hit's answer, its JSON already serialized. Built here, not through
 * hono's `c.header` and `c.body`, which make a second `Headers` for the
 * `Response` to copy: each such runtime object lives until a full garbage
 * collection, and is then finalized on the isolate's one thread.
 */
function json(body: string, serverTiming: string): Response {
	return new Response(body, {
		headers: {
			"Content-Type": "application/json",
			"Server-Timing": serverTiming,
		},
	});
}

/**
 * The hit with result id `id` from this isolate's memory, counted for the
 * task graph (sent in batches, off the response's path); null when the
 * isolate does not hold it.
 */
function edgeHit(
	c: Context<AppEnv>,
	id: string,
	start: number,
): Response | null {
	const scope = c.get("scope");
	const edge = cachedHit(c.env, scope, id);
	if (!edge) return null;
	const send = countEdgeHit(
		scope,
		{ id, tool: edge.tool, execMs: edge.execMs },
		() => graph(c),
	);
	if (send) c.executionCtx.waitUntil(send);
	return json(edge.json, timing(start, { edge: performance.now() - start }));
}

tasks.get(
	"/",
	allow(["trainer", "host", "admin"]),
	valid("query", TaskListQuery),
	async (c) => {
		const p = c.get("principal");
		if (p.kind !== "key")
			throw apiError(403, "forbidden", "the root admin key sees no task");
		const { after, limit } = c.req.valid("query");
		const { results } = await c.env.DB.prepare(
			`select task, created_at as createdAt, last_used_at as lastUsedAt, nodes,
			   snapshots, bytes, lookups, hits
			 from tasks where project_id = ?1 and task > ?2 order by task limit ?3`,
		)
			.bind(p.project, after ?? "", limit + 1)
			.all<TaskInfo>();
		const page = results.slice(0, limit);
		return c.json({
			tasks: page,
			next: results.length > limit ? page[page.length - 1].task : null,
		} satisfies TaskPage);
	},
);

tasks.post(
	"/:task/lookup",
	task,
	trainer,
	jsonBody(LIMITS.lookupBody),
	async (c) => {
		const start = performance.now();
		const text = await jsonText(c);
		// A body this isolate answered with a hit: no parsing, no hashing.
		const seen = text === null ? undefined : seenLookup(c.env, text);
		if (seen) {
			const edge = edgeHit(c, seen, start);
			if (edge) return edge;
		}
		const req = parseJson(LookupRequest, text);
		const scope = c.get("scope");
		const call = {
			tool: req.call.tool,
			args: req.call.args ?? null,
			mutates: mutates(req.call),
		};
		const key = callKey(call);

		// The state the call runs at, and its result id, from the client's view.
		let state: string;
		let path: { tool: string; args: unknown; id: string }[] | undefined;
		if (req.cursor !== undefined) {
			state = req.cursor;
		} else {
			const steps = pathIds(req.history!);
			path = [];
			for (const [i, s] of steps.entries()) {
				if (!s.mutates) continue;
				const h = req.history![i];
				path.push({ tool: h.tool, args: h.args ?? null, id: s.id });
			}
			state = path.length > 0 ? path[path.length - 1].id : ROOT_ID;
		}
		const id = call.mutates ? childId(state, key) : obsId(state, key);

		const edge = edgeHit(c, id, start);
		if (edge) {
			if (text !== null) rememberLookup(c.env, text, id);
			return edge;
		}

		const t0 = performance.now();
		// RPC's serializable-type mapping erases `args: unknown`; the shape is the method's.
		const r = unwrap(
			(await graph(c).lookup(scope, {
				call: { ...call, id },
				path,
				cursor: req.cursor,
				lease: req.lease ?? true,
				leaseTtlMs: leaseTtl(c.env, req.leaseTtlMs),
			})) as Result<StoredHit | Miss>,
		);
		const took = timing(start, { graph: performance.now() - t0 });
		if (r.status === "hit") {
			const hit = await materialize(c.env, r);
			const answer = rememberHit(c.env, scope, call.tool, hit);
			if (text !== null) rememberLookup(c.env, text, id);
			return json(answer, took);
		}
		c.header("Server-Timing", took);
		return c.json(r satisfies LookupResponse);
	},
);

tasks.get("/:task/results/:id", task, trainer, async (c) => {
	const start = performance.now();
	const id = Id.safeParse(c.req.param("id"));
	if (!id.success)
		throw apiError(
			400,
			"invalid_request",
			"id: must be 64 lowercase hex digits",
		);
	const edge = edgeHit(c, id.data, start);
	if (edge) return edge;
	const scope = c.get("scope");
	const t0 = performance.now();
	const r = await graph(c).result(scope, id.data);
	const took = timing(start, { graph: performance.now() - t0 });
	if (r === null) {
		c.header("Server-Timing", took);
		throw apiError(404, "not_found", "no result with this id is recorded");
	}
	const hit = await materialize(c.env, r.hit);
	return json(rememberHit(c.env, scope, r.tool, hit), took);
});

tasks.post(
	"/:task/record",
	task,
	trainer,
	jsonBody(LIMITS.recordBody),
	valid("json", RecordRequest),
	async (c) => {
		const req = c.req.valid("json");
		const maxOutput = Number(c.env.OUTPUT_MAX_BYTES);
		const encoder = new TextEncoder();
		for (const [i, call] of req.calls.entries()) {
			// Strings are at most 3 UTF-8 bytes a code unit; only measure when close.
			if (
				call.output.length * 3 > maxOutput &&
				encoder.encode(call.output).byteLength > maxOutput
			) {
				throw apiError(
					413,
					"output_too_large",
					`calls.${i}.output is larger than ${maxOutput} bytes`,
				);
			}
		}
		const scope = c.get("scope");
		const steps = pathIds(req.calls, req.from);
		const { refs: snapshots, missing } = await checkSnapshots(
			c.env,
			scope,
			req.calls.map((call) => call.snapshot),
			steps.map((step) => step.id),
		);
		const budgets = await budgetsFor(c.env, scope.project);
		const refused = await quotaError(c.env, scope.project, scope.task, budgets);
		if (refused) throw apiError(403, "quota_exceeded", refused);
		const recorded = await graph(c).record(c.get("scope"), {
			from: req.from,
			calls: req.calls.map((call, i) => ({
				tool: call.tool,
				args: call.args ?? null,
				mutates: steps[i].mutates,
				id: steps[i].id,
				output: call.output,
				exitCode: call.exitCode,
				execMs: call.execMs,
				snapshot: snapshots[i],
			})),
			inlineMaxBytes: Number(c.env.OUTPUT_INLINE_MAX_BYTES),
			budgets,
		});
		// Storage refused a write: nothing was recorded, and a retry may work.
		if (!recorded.ok && recorded.status === 503) {
			throw apiError(503, recorded.code, recorded.message, {
				"Retry-After": "1",
			});
		}
		const r = unwrap(recorded);
		for (const i of missing) r.results[i].snapshot = "missing";
		// The graph computes the final state the same way; say so if it ever does not.
		const want = steps.findLast((s) => s.mutates)?.id ?? req.from;
		if (r.state !== want) throw new Error("final state mismatch");
		// A node this record created holds exactly what it sent, and never
		// changes: the next lookup of it, a sibling rollout's, is an edge hit.
		// An `exists` or `conflict` keeps what the graph had; not known here.
		for (const [i, result] of r.results.entries()) {
			if (result.status !== "recorded") continue;
			const call = req.calls[i];
			const step = steps[i];
			rememberRecorded(c.env, scope, call.tool, {
				status: "hit",
				tier: "exact",
				id: step.id,
				state: step.mutates ? step.id : step.state,
				output: call.output,
				exitCode: call.exitCode,
				execMs: call.execMs,
			});
		}
		return c.json(r);
	},
);

tasks.post(
	"/:task/leases",
	task,
	trainer,
	jsonBody(LIMITS.adminBody),
	valid("json", LeaseRequest),
	async (c) => {
		const { state, ttlMs } = c.req.valid("json");
		const lease = unwrap(
			await graph(c).acquireLease(
				c.get("scope"),
				state,
				leaseTtl(c.env, ttlMs),
			),
		);
		return c.json(lease, 201);
	},
);

tasks.post(
	"/:task/leases/:lease/renew",
	task,
	trainer,
	jsonBody(LIMITS.adminBody),
	valid("json", RenewRequest),
	async (c) => {
		const { ttlMs } = c.req.valid("json");
		const lease = unwrap(
			await graph(c).renewLease(c.req.param("lease"), leaseTtl(c.env, ttlMs)),
		);
		return c.json(lease);
	},
);

tasks.delete("/:task/leases/:lease", task, trainer, async (c) => {
	return c.json(unwrap(await graph(c).releaseLease(c.req.param("lease"))));
});

/** What a task graph read gave; 404 for a task that holds nothing (null). */
function used<T>(read: T | null): T {
	if (read === null)
		throw apiError(404, "task_not_found", "this task has nothing recorded");
	return read;
}

tasks.get(
	"/:task/stats",
	task,
	allow(["trainer", "host", "admin"]),
	async (c) => {
		const scope = c.get("scope");
		await sendPending(graph(c), takePending(scope));
		return c.json(used(await graph(c).stats(scope)));
	},
);

tasks.get(
	"/:task/evictions",
	task,
	allow(["trainer", "host", "admin"]),
	valid("query", EvictionLogQuery),
	async (c) => {
		const { after, limit } = c.req.valid("query");
		return c.json(used(await graph(c).evictionLog(after ?? 0, limit)));
	},
);

tasks.get(
	"/:task/graph",
	task,
	allow(["trainer", "host", "admin"]),
	valid("query", GraphQuery),
	async (c) => {
		const { after, limit } = c.req.valid("query");
		return c.json(used(await graph(c).graph(after ?? 0, limit)));
	},
);
