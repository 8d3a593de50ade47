import { env } from "cloudflare:workers";
import {
	abortAllDurableObjects,
	runDurableObjectAlarm,
	runInDurableObject,
} from "cloudflare:test";
import { beforeAll, describe, expect, it } from "vitest";
import { advanceClock, now } from "../../core/clock.ts";
import { callKey, childId, obsId } from "../../core/ids.ts";
import {
	EDGE_TTL_MS,
	SEEN_MAX_CHARS,
	cachedHit,
	seenLookup,
} from "../../functions/edge-cache.ts";
import {
	NO_EDGE,
	ROOT_ID,
	api,
	bash,
	expectError,
	project,
	run,
	taskApi,
	unsizedBody,
	snapshotBlob,
} from "./helpers.ts";

let keys: Awaited<ReturnType<typeof project>>;
beforeAll(async () => {
	keys = await project("cache");
});

const M1 = bash("git clone repo");
const M2 = bash("patch foo.py");
const R1 = bash("cat foo.py", false);
const R2 = bash("ls", false);

describe("lookup and record", () => {
	it("misses on a new task, then hits after the call is recorded", async () => {
		const t = taskApi(keys.trainer, "first");
		const miss = await t.lookup({ history: [], call: M1 });
		expect(miss.status).toBe(200);
		expect(miss.headers.get("server-timing")).toMatch(
			/^graph;dur=[0-9.]+, total;dur=/,
		);
		expect(miss.body).toMatchObject({
			status: "miss",
			state: ROOT_ID,
			depth: 0,
			snapshot: null,
			resume: ROOT_ID,
			replay: [],
			lease: null,
		});
		const id = childId(ROOT_ID, callKey(M1));
		expect(miss.body.id).toBe(id);

		const rec = await t.record({
			from: ROOT_ID,
			calls: [run(M1, "cloned", 3000)],
		});
		expect(rec.status).toBe(200);
		expect(rec.body).toEqual({
			state: id,
			results: [{ id, status: "recorded" }],
			conflicts: 0,
		});

		const hit = await t.lookup({ history: [], call: M1 });
		expect(hit.body).toEqual({
			status: "hit",
			tier: "exact",
			id,
			state: id,
			output: "cloned",
			exitCode: 0,
			execMs: 3000,
		});
		expect(hit.headers.get("server-timing")).toMatch(/total;dur=/);
	});

	it("keys on the state path: the same call after a patch is a different entry", async () => {
		const t = taskApi(keys.trainer, "patch");
		await t.record({
			from: ROOT_ID,
			calls: [run(M1, "cloned"), run(R1, "old body")],
		});
		await t.record({
			from: ROOT_ID,
			calls: [run(M1, "cloned"), run(M2, "patched"), run(R1, "new body")],
		});

		const before = await t.lookup({ history: [M1], call: R1 });
		const after = await t.lookup({ history: [M1, M2], call: R1 });
		expect(before.body).toMatchObject({ status: "hit", output: "old body" });
		expect(after.body).toMatchObject({ status: "hit", output: "new body" });
	});

	it("skips stateless calls when matching, in any order", async () => {
		const t = taskApi(keys.trainer, "stateless");
		await t.record({
			from: ROOT_ID,
			calls: [run(M1, "a"), run(R1, "r1"), run(M2, "b"), run(R2, "r2")],
		});
		// The same state path with the reads moved around, or absent.
		for (const history of [
			[M1, M2],
			[R1, M1, R2, M2],
			[M1, R2, R1, M2, R1],
		]) {
			const r = await t.lookup({ history, call: R2 });
			expect(r.body).toMatchObject({ status: "hit", output: "r2" });
		}
		const s1 = childId(ROOT_ID, callKey(M1));
		expect(
			(await t.lookup({ history: [R2, M1], call: R1 })).body,
		).toMatchObject({
			status: "hit",
			id: obsId(s1, callKey(R1)),
			state: s1,
			output: "r1",
		});
	});

	it("on a partial match returns the matched depth and only the state-changing calls to replay", async () => {
		const t = taskApi(keys.trainer, "partial");
		const M3 = bash("make");
		await t.record({ from: ROOT_ID, calls: [run(M1, "a"), run(R1, "r")] });
		const r = await t.lookup({ history: [M1, R1, M2, R2], call: M3 });
		const s1 = childId(ROOT_ID, callKey(M1));
		const s2 = childId(s1, callKey(M2));
		expect(r.body).toMatchObject({
			status: "miss",
			state: s1,
			depth: 1,
			resume: ROOT_ID,
		});
		// From the root (no snapshot): M1 (held) and M2 (unseen); never the reads.
		expect(r.body.replay).toEqual([
			{ tool: "bash", args: M1.args, id: s1 },
			{ tool: "bash", args: M2.args, id: s2 },
		]);
		expect(r.body.id).toBe(childId(s2, callKey(M3)));
	});

	it("looks up by cursor, and refuses a cursor the task does not hold with 409", async () => {
		const t = taskApi(keys.trainer, "cursor");
		const rec = await t.record({
			from: ROOT_ID,
			calls: [run(M1, "a"), run(M2, "b")],
		});
		const hit = await t.lookup({ cursor: rec.body.results[0].id, call: M2 });
		expect(hit.body).toMatchObject({
			status: "hit",
			output: "b",
			state: rec.body.state,
		});
		const miss = await t.lookup({ cursor: rec.body.state, call: R1 });
		expect(miss.body).toMatchObject({
			status: "miss",
			depth: 2,
			resume: ROOT_ID,
		});
		expect(miss.body.replay.map((c: { id: string }) => c.id)).toEqual(
			rec.body.results.map((r: { id: string }) => r.id),
		);

		const unknown = childId(rec.body.state, callKey(bash("never ran")));
		const stale = await t.lookup({ cursor: unknown, call: R1 });
		expectError(stale, 409, "stale_cursor");
	});

	it("resumes from the deepest snapshot on the matched path and replays only below it", async () => {
		const t = taskApi(keys.trainer, "snap");
		const M3 = bash("make");
		const s1 = childId(ROOT_ID, callKey(M1));
		const s2 = childId(s1, callKey(M2));
		// A record's ref must name a blob of this task and state that R2 holds.
		const snap = await snapshotBlob("cache", "snap", s2, 42);
		await t.record({
			from: ROOT_ID,
			calls: [run(M1, "a"), { ...run(M2, "b"), snapshot: snap }, run(M3, "c")],
		});
		const s3 = childId(s2, callKey(M3));
		const M4 = bash("test");
		const r = await t.lookup({ history: [M1, M2, M3], call: M4 });
		expect(r.body).toMatchObject({
			status: "miss",
			state: s3,
			depth: 3,
			resume: s2,
			snapshot: { ...snap, state: s2, depth: 2 },
			replay: [{ tool: "bash", args: M3.args, id: s3 }],
		});
		expect(r.body.lease).toMatchObject({ state: s2 });
		expect(r.body.lease.expiresAt).toBeGreaterThan(Date.now());
		expect((await t.stats()).body.leases).toBe(1);

		const noLease = await t.lookup({
			history: [M1, M2, M3],
			call: M4,
			lease: false,
		});
		expect(noLease.body.lease).toBeNull();
	});

	it("is idempotent: recording the same run twice changes nothing", async () => {
		const t = taskApi(keys.trainer, "idem");
		const body = { from: ROOT_ID, calls: [run(M1, "a"), run(R1, "r")] };
		await t.record(body);
		const graph1 = (await t.graph()).body;
		const stats1 = (await t.stats()).body;
		expect(stats1.tools.bash.records).toBe(2);
		const again = await t.record(body);
		expect(again.body.results.map((r: { status: string }) => r.status)).toEqual(
			["exists", "exists"],
		);
		expect(again.body.conflicts).toBe(0);
		expect((await t.graph()).body.nodes).toEqual(graph1.nodes);
		// Not in the counters either: `records` counts nodes recorded.
		expect((await t.stats()).body).toEqual(stats1);
	});

	it("keeps the first output when a later record differs, reports it, and flags the tool", async () => {
		const t = taskApi(keys.trainer, "conflict");
		await t.record({ from: ROOT_ID, calls: [run(bash("date"), "Monday")] });
		const again = await t.record({
			from: ROOT_ID,
			calls: [run(bash("date"), "Tuesday")],
		});
		expect(again.body.results[0].status).toBe("conflict");
		expect(again.body.conflicts).toBe(1);
		const exitDiffers = await t.record({
			from: ROOT_ID,
			calls: [run(bash("date"), "Monday", 100, 1)],
		});
		expect(exitDiffers.body.results[0].status).toBe("conflict");

		expect(
			(await t.lookup({ history: [], call: bash("date") })).body.output,
		).toBe("Monday");
		const stats = (await t.stats()).body;
		expect(stats.conflicts).toBe(2);
		expect(stats.tools.bash.nondeterministic).toBe(true);

		// A retry of a conflicting record is told again, and counted once.
		const retried = await t.record({
			from: ROOT_ID,
			calls: [run(bash("date"), "Tuesday")],
		});
		expect(retried.body.results[0].status).toBe("conflict");
		expect(retried.body.conflicts).toBe(1);
		expect((await t.stats()).body.conflicts).toBe(2);
		expect((await t.stats()).body.tools.bash.conflicts).toBe(2);
		// Another different output counts.
		await t.record({ from: ROOT_ID, calls: [run(bash("date"), "Friday")] });
		expect((await t.stats()).body.conflicts).toBe(3);
	});

	it("records from a held state, and refuses an unknown `from` with 409 writing nothing", async () => {
		const t = taskApi(keys.trainer, "from");
		const first = await t.record({ from: ROOT_ID, calls: [run(M1, "a")] });
		const next = await t.record({
			from: first.body.state,
			calls: [run(M2, "b")],
		});
		expect(next.status).toBe(200);
		expect((await t.lookup({ history: [M1], call: M2 })).body.output).toBe("b");

		const before = (await t.graph()).body.nodes.length;
		const bad = await t.record({
			from: childId(ROOT_ID, callKey(R1)),
			calls: [run(M2, "b")],
		});
		expectError(bad, 409, "unknown_state");
		expect((await t.graph()).body.nodes.length).toBe(before);
	});

	it("refuses a stateless result's id where a state is expected", async () => {
		const t = taskApi(keys.trainer, "not-a-state");
		const rec = await t.record({ from: ROOT_ID, calls: [run(R1, "r")] });
		const resultId = rec.body.results[0].id;
		expect(rec.body.state).toBe(ROOT_ID);
		expectError(
			await t.record({ from: resultId, calls: [run(M1, "a")] }),
			409,
			"unknown_state",
		);
		expectError(
			await t.lookup({ cursor: resultId, call: M1 }),
			409,
			"stale_cursor",
		);
		expectError(await t.lease({ state: resultId }), 404, "state_not_found");
		expect((await t.stats()).body.nodes).toBe(2);
	});

	it("stores outputs over the inline threshold in R2 and serves them back", async () => {
		const t = taskApi(keys.trainer, "large");
		const big = "x".repeat(5000) + "ünïcødé";
		const rec = await t.record({ from: ROOT_ID, calls: [run(M1, big)] });
		expect(rec.body.results[0].status).toBe("recorded");
		const listed = await env.BLOBS.list({ prefix: "outputs/cache/large/" });
		expect(listed.objects).toHaveLength(1);
		expect((await t.lookup({ history: [], call: M1 })).body.output).toBe(big);
		// The same large output again is `exists`, a different one a conflict; neither adds a blob.
		expect(
			(await t.record({ from: ROOT_ID, calls: [run(M1, big)] })).body.results[0]
				.status,
		).toBe("exists");
		expect(
			(await t.record({ from: ROOT_ID, calls: [run(M1, big + "!")] })).body
				.results[0].status,
		).toBe("conflict");
		expect(
			(await env.BLOBS.list({ prefix: "outputs/cache/large/" })).objects,
		).toHaveLength(1);
	});

	it("answers a result by id, and 404 for one never recorded", async () => {
		const t = taskApi(keys.trainer, "byid");
		const rec = await t.record({ from: ROOT_ID, calls: [run(M1, "a")] });
		const r = await t.result(rec.body.state);
		expect(r.body).toMatchObject({ status: "hit", output: "a" });
		expectError(
			await t.result(childId(ROOT_ID, callKey(M2))),
			404,
			"not_found",
		);
		expectError(await t.result("not-an-id"), 400, "invalid_request");
	});

	it("serves repeated hits from the Worker's memory and still counts them", async () => {
		const t = taskApi(keys.trainer, "edge");
		// Recorded with the edge cache off: the first hit is the graph's.
		await taskApi(keys.trainer, "edge", NO_EDGE).record({
			from: ROOT_ID,
			calls: [run(M1, "a", 250)],
		});
		const first = await t.lookup({ history: [], call: M1 });
		expect(first.headers.get("server-timing")).toMatch(/^graph;/);
		const second = await t.lookup({ history: [], call: M1 });
		expect(second.headers.get("server-timing")).toMatch(/^edge;/);
		expect(second.body).toEqual(first.body);
		const stats = (await t.stats()).body;
		expect(stats.hits).toBe(2);
		expect(stats.savedMs).toBe(500);
		expect(stats.tools.bash).toMatchObject({ lookups: 2, hits: 2, misses: 0 });
	});

	it("remembers the text of a lookup it answered with a hit, and of no other", async () => {
		const t = taskApi(keys.trainer, "seen");
		// Calls no other test sends: the texts are this isolate's first.
		const [hitCall, longCall] = [
			bash("seen 1"),
			bash("x".repeat(SEEN_MAX_CHARS)),
		];
		const hitBody = { history: [], call: hitCall };
		const missBody = { history: [], call: bash("seen 2") };
		const long = { history: [hitCall], call: longCall };
		await t.record({
			from: ROOT_ID,
			calls: [run(hitCall, "a"), run(longCall, "b")],
		});
		const text = (b: unknown) => JSON.stringify(b);
		for (const b of [hitBody, missBody, long])
			expect(seenLookup(env, text(b))).toBeUndefined();
		const first = await t.lookup(hitBody);
		expect((await t.lookup(missBody)).body.status).toBe("miss");
		expect((await t.lookup(long)).body.status).toBe("hit");
		expect(seenLookup(env, text(hitBody))).toBe(first.body.id);
		expect(seenLookup(env, text(missBody))).toBeUndefined();
		expect(seenLookup(env, text(long))).toBeUndefined();
		// The same text again: the same answer, from memory.
		const again = await t.lookup(hitBody);
		expect(again.headers.get("server-timing")).toMatch(/^edge;/);
		expect(again.body).toEqual(first.body);
		// Another text of the same lookup is parsed on its own, to the same id.
		const spaced = JSON.stringify(hitBody, null, 1);
		expect(seenLookup(env, spaced)).toBeUndefined();
		const r = await api("POST", "/v1/tasks/seen/lookup", {
			key: keys.trainer,
			body: spaced,
			headers: { "content-type": "application/json" },
		});
		expect(r.body).toEqual(first.body);
		expect(seenLookup(env, spaced)).toBe(first.body.id);
		expect((await t.stats()).body).toMatchObject({ lookups: 5, hits: 4 });
	});

	it("never takes a hit's own key, sent as a body, for a remembered body", async () => {
		const t = taskApi(keys.trainer, "seen-key");
		const rec = await t.record({
			from: ROOT_ID,
			calls: [run(bash("seen 4"), "a")],
		});
		const id = rec.body.results[0].id;
		// The cache's key of that hit: not JSON, so never a body it keeps.
		const hitKey = `${keys.name}\u0000seen-key\u0000${id}`;
		expect(
			cachedHit(env, { project: keys.name, task: "seen-key" }, id),
		).toBeDefined();
		expect(seenLookup(env, hitKey)).toBeUndefined();
		const r = await api("POST", "/v1/tasks/seen-key/lookup", {
			key: keys.trainer,
			body: hitKey,
			headers: { "content-type": "application/json" },
		});
		expectError(r, 400, "invalid_json");
	});

	it("remembers no lookup text with the edge cache off", async () => {
		const t = taskApi(keys.trainer, "seen-off", NO_EDGE);
		await t.record({ from: ROOT_ID, calls: [run(bash("seen 3"), "a")] });
		const body = { history: [], call: bash("seen 3") };
		expect((await t.lookup(body)).body.status).toBe("hit");
		expect((await t.lookup(body)).headers.get("server-timing")).toMatch(
			/^graph;/,
		);
		// Nothing reached the cache the configured bindings use.
		expect(seenLookup(env, JSON.stringify(body))).toBeUndefined();
	});

	it("answers the same lookup text in another task by that task's graph", async () => {
		// The Worker remembers what a lookup's text parses to; the answer
		// still comes from the task in the path.
		const a = taskApi(keys.trainer, "same-text-a");
		const b = taskApi(keys.trainer, "same-text-b");
		await a.record({ from: ROOT_ID, calls: [run(M1, "a's output")] });
		const ask = { history: [], call: M1 };
		for (let i = 0; i < 2; i++) {
			expect((await a.lookup(ask)).body).toMatchObject({
				status: "hit",
				output: "a's output",
			});
			expect((await b.lookup(ask)).body).toMatchObject({
				status: "miss",
				depth: 0,
			});
		}
		expect((await b.stats()).body).toMatchObject({ lookups: 2, misses: 2 });
	});

	it("answers the first lookup of what it recorded from memory, as the graph would", async () => {
		const t = taskApi(keys.trainer, "edge-record");
		const viaGraph = taskApi(keys.trainer, "edge-record-graph", NO_EDGE);
		const calls = [run(M1, "a", 30), run(R1, "b", 20, 1), run(M2, "c", 10)];
		await t.record({ from: ROOT_ID, calls });
		await viaGraph.record({ from: ROOT_ID, calls });
		for (const [history, call] of [
			[[], M1],
			[[M1], R1],
			[[M1, R1], M2],
		] as const) {
			const edge = await t.lookup({ history, call });
			expect(edge.headers.get("server-timing")).toMatch(/^edge;/);
			const graph = await viaGraph.lookup({ history, call });
			expect(graph.headers.get("server-timing")).toMatch(/^graph;/);
			// The same answer, to the byte, whichever part gave it.
			expect(JSON.stringify(edge.body)).toBe(JSON.stringify(graph.body));
			// And by result id: the same hit, and the same header.
			const byId = await t.result(edge.body.id);
			expect(byId.headers.get("server-timing")).toMatch(/^edge;.*total;dur=/);
			expect(byId.body).toEqual(edge.body);
			const byIdGraph = await viaGraph.result(edge.body.id);
			expect(byIdGraph.headers.get("server-timing")).toMatch(/^graph;/);
			expect(byIdGraph.body).toEqual(edge.body);
		}
		const stats = (await t.stats()).body;
		expect(stats).toMatchObject({ lookups: 6, hits: 6, savedMs: 120 });
	});

	it("keeps the first output at the edge when a record conflicts with it", async () => {
		const t = taskApi(keys.trainer, "edge-conflict");
		await t.record({ from: ROOT_ID, calls: [run(M1, "first", 5)] });
		const again = await t.record({
			from: ROOT_ID,
			calls: [run(M1, "second", 7)],
		});
		expect(again.body.results[0].status).toBe("conflict");
		const same = await t.record({
			from: ROOT_ID,
			calls: [run(M1, "first", 9)],
		});
		expect(same.body.results[0].status).toBe("exists");
		const hit = await t.lookup({ history: [], call: M1 });
		expect(hit.headers.get("server-timing")).toMatch(/^edge;/);
		expect(hit.body).toMatchObject({ output: "first", execMs: 5 });
		expect((await t.result(hit.body.id)).body).toEqual(hit.body);
	});

	it("stops answering from memory once the task is idle long enough to be deleted", async () => {
		const t = taskApi(keys.trainer, "edge-ttl");
		await t.record({ from: ROOT_ID, calls: [run(M1, "a")] });
		expect(
			(await t.lookup({ history: [], call: M1 })).headers.get("server-timing"),
		).toMatch(/^edge;/);
		advanceClock(Math.min(EDGE_TTL_MS, Number(env.IDLE_TASK_TTL_MS) / 2) + 1);
		const later = await t.lookup({ history: [], call: M1 });
		expect(later.headers.get("server-timing")).toMatch(/^graph;/);
		expect(later.body).toMatchObject({ status: "hit", output: "a" });
	});

	it("sends an edge hit's count within a second, with no traffic after it", async () => {
		const task = "edge-quiet";
		await taskApi(keys.trainer, task, NO_EDGE).record({
			from: ROOT_ID,
			calls: [run(M1, "a", 70)],
		});
		// Through the fetch handler with the configured bindings: the reply
		// comes back once the request's waitUntil work is done.
		const t = taskApi(keys.trainer, task, env);
		await t.lookup({ history: [], call: M1 }); // the graph's hit
		const edge = await t.lookup({ history: [], call: M1 });
		expect(edge.headers.get("server-timing")).toMatch(/^edge;/);
		// Read the graph directly: a stats read through the Worker would
		// take the unsent batch itself.
		const stub = env.TASK_GRAPH.get(
			env.TASK_GRAPH.idFromName(`${keys.name}/${task}`),
		);
		const stats = await stub.stats({ project: keys.name, task });
		expect(stats).toMatchObject({ lookups: 2, hits: 2, savedMs: 140 });
	});

	it("counts a batch of edge hits per node and per tool, several to a node", async () => {
		const t = taskApi(keys.trainer, "edge-batch");
		await t.record({ from: ROOT_ID, calls: [run(M1, "a", 100)] });
		await t.record({ from: ROOT_ID, calls: [run(M2, "b", 10)] });
		for (let i = 0; i < 5; i++) await t.lookup({ history: [], call: M1 });
		for (let i = 0; i < 3; i++) await t.lookup({ history: [], call: M2 });
		const stats = (await t.stats()).body;
		expect(stats).toMatchObject({ lookups: 8, hits: 8, savedMs: 530 });
		const nodes = (await t.graph()).body.nodes;
		const hits = (cmd: string) =>
			nodes.find((n: { args: { cmd?: string } | null }) => n.args?.cmd === cmd)
				.hits;
		expect([hits("git clone repo"), hits("patch foo.py")]).toEqual([5, 3]);
	});

	it("writes a lookup's counters, and an edge batch's, in the next alarm, not in the request", async () => {
		const t = taskApi(keys.trainer, "deferred");
		await taskApi(keys.trainer, "deferred", NO_EDGE).record({
			from: ROOT_ID,
			calls: [run(M1, "a", 40)],
		});
		await t.lookup({ history: [], call: M1 }); // a hit, answered by the graph
		await t.lookup({ history: [], call: M2 }); // a miss
		const stub = env.TASK_GRAPH.get(
			env.TASK_GRAPH.idFromName(`${keys.name}/deferred`),
		);
		// A batch of hits the Worker answered from memory: counted, not written.
		await stub.countHits({ project: keys.name, task: "deferred" }, [
			{ id: childId(ROOT_ID, callKey(M1)), tool: "bash", execMs: 40 },
		]);
		const stored = () =>
			runInDurableObject(stub, (_, state) => ({
				tool: state.storage.sql
					.exec("select lookups, hits, misses, saved_ms from tool_stats")
					.toArray(),
				hits: state.storage.sql
					.exec(
						"select hits from nodes where id = ?",
						childId(ROOT_ID, callKey(M1)),
					)
					.one().hits,
			}));
		// The record wrote the tool's row; neither lookup has touched it yet.
		expect(await stored()).toEqual({
			tool: [{ lookups: 0, hits: 0, misses: 0, saved_ms: 0 }],
			hits: 0,
		});
		expect(await runDurableObjectAlarm(stub)).toBe(true);
		expect(await stored()).toEqual({
			tool: [{ lookups: 3, hits: 2, misses: 1, saved_ms: 80 }],
			hits: 2,
		});
	});

	it("writes a node's hit count at most every 30 s from its alarm, at once for a read", async () => {
		const t = taskApi(keys.trainer, "node-hits");
		await t.record({ from: ROOT_ID, calls: [run(M1, "a", 40)] });
		const id = childId(ROOT_ID, callKey(M1));
		const stub = env.TASK_GRAPH.get(
			env.TASK_GRAPH.idFromName(`${keys.name}/node-hits`),
		);
		const scope = { project: keys.name, task: "node-hits" };
		const hit = { id, tool: "bash", execMs: 40 };
		const stored = () =>
			runInDurableObject(stub, (_, state) => ({
				tool: state.storage.sql.exec("select hits from tool_stats").one().hits,
				node: state.storage.sql
					.exec("select hits from nodes where id = ?", id)
					.one().hits,
			}));
		// The first alarm writes both.
		await stub.countHits(scope, [hit]);
		expect(await runDurableObjectAlarm(stub)).toBe(true);
		expect(await stored()).toEqual({ tool: 1, node: 1 });
		// The next one writes the tool's counters only.
		await stub.countHits(scope, [hit, hit]);
		expect(await runDurableObjectAlarm(stub)).toBe(true);
		expect(await stored()).toEqual({ tool: 3, node: 1 });
		// 30 s after the last write, an alarm (armed for it) writes the node's.
		advanceClock(30_000);
		expect(await runDurableObjectAlarm(stub)).toBe(true);
		expect(await stored()).toEqual({ tool: 3, node: 3 });
		// A read writes them at once, and counts what it reads.
		await stub.countHits(scope, [hit]);
		const graph = (await t.graph()).body;
		expect(graph.nodes.find((n: { id: string }) => n.id === id).hits).toBe(4);
		expect(await stored()).toEqual({ tool: 4, node: 4 });
	});

	it("writes a round of node hit counts 2,048 nodes an alarm, the rest at the next ones", async () => {
		const t = taskApi(keys.trainer, "node-hit-rounds");
		const calls = Array.from({ length: 2100 }, (_, i) =>
			bash(`cat f${i}`, false),
		);
		await t.record({
			from: ROOT_ID,
			calls: calls.map((c, i) => run(c, `o${i}`, 1)),
		});
		const stub = env.TASK_GRAPH.get(
			env.TASK_GRAPH.idFromName(`${keys.name}/node-hit-rounds`),
		);
		const scope = { project: keys.name, task: "node-hit-rounds" };
		await stub.countHits(
			scope,
			calls.map((c) => ({
				id: obsId(ROOT_ID, callKey(c)),
				tool: "bash",
				execMs: 1,
			})),
		);
		const stored = () =>
			runInDurableObject(stub, async (_, state) => ({
				tool: state.storage.sql.exec("select hits from tool_stats").one().hits,
				nodes: state.storage.sql
					.exec("select count(*) as n from nodes where hits = 1")
					.one().n,
				alarmIn: ((await state.storage.getAlarm()) ?? Infinity) - now(),
			}));
		// The first alarm counts every hit for the tool, and writes 2,048 nodes'.
		expect(await runDurableObjectAlarm(stub)).toBe(true);
		const first = await stored();
		expect(first).toMatchObject({ tool: 2100, nodes: 2048 });
		// The round goes on at the next alarm, seconds away rather than 30 s.
		expect(first.alarmIn).toBeLessThanOrEqual(2000);
		expect(await runDurableObjectAlarm(stub)).toBe(true);
		const second = await stored();
		expect(second).toMatchObject({ tool: 2100, nodes: 2100 });
		// With every node written, no alarm is left for them.
		expect(second.alarmIn).toBe(Infinity);
	});

	it("reads a lookup body sent without a length, as one that says it", async () => {
		const t = taskApi(keys.trainer, "streamed");
		await t.record({ from: ROOT_ID, calls: [run(M1, "a", 40)] });
		const r = await api("POST", "/v1/tasks/streamed/lookup", {
			key: keys.trainer,
			body: unsizedBody(JSON.stringify({ history: [], call: M1 })),
			headers: { "content-type": "application/json" },
		});
		expect(r.status).toBe(200);
		expect(r.body).toMatchObject({ status: "hit", output: "a" });
		expect(r.headers.get("server-timing")).toMatch(/^(edge|graph);dur=/);
	});

	it("keeps every acknowledged record across a restart of the task graph", async () => {
		const t = taskApi(keys.trainer, "restart");
		const rec = await t.record({
			from: ROOT_ID,
			calls: [run(M1, "a"), run(M2, "b"), run(R1, "r")],
		});
		await abortAllDurableObjects();
		// A cursor only works if the rebuilt index knows the state.
		expect(
			(await t.lookup({ cursor: rec.body.state, call: R1 })).body,
		).toMatchObject({
			status: "hit",
			output: "r",
		});
		expect(
			(await t.record({ from: ROOT_ID, calls: [run(M1, "a")] })).body.results[0]
				.status,
		).toBe("exists");
		expect((await t.stats()).body.nodes).toBe(4);
	});
});

describe("stats and graph", () => {
	it("counts lookups, hits, misses and time saved per tool", async () => {
		const t = taskApi(keys.trainer, "stats");
		await t.lookup({ history: [], call: M1 });
		await t.record({
			from: ROOT_ID,
			calls: [
				run(M1, "a", 1000),
				run({ tool: "sql", args: "select 1", mutates: false }, "1", 5),
			],
		});
		await t.lookup({ history: [], call: M1 });
		await t.lookup({
			history: [M1],
			call: { tool: "sql", args: "select 1", mutates: false },
		});
		const s = (await t.stats()).body;
		expect(s).toMatchObject({
			task: "stats",
			lookups: 3,
			hits: 2,
			misses: 1,
			savedMs: 1005,
			nodes: 3,
			states: 1,
			results: 1,
			snapshots: 0,
			outputBytes: 2,
		});
		expect(s.hitRate).toBeCloseTo(2 / 3);
		expect(s.tools.sql).toMatchObject({
			lookups: 1,
			hits: 1,
			records: 1,
			nondeterministic: false,
		});
	});

	it("exports the tree in pages, parents before children", async () => {
		const t = taskApi(keys.trainer, "pages");
		const calls = Array.from({ length: 7 }, (_, i) =>
			run(bash(`step ${i}`), `out ${i}`),
		);
		await t.record({ from: ROOT_ID, calls });
		const seen: { id: string; parent: string | null; depth: number }[] = [];
		let after: number | null = 0;
		let pages = 0;
		while (after !== null) {
			const page = await t.graph(`?after=${after}&limit=3`);
			expect(page.status).toBe(200);
			seen.push(...page.body.nodes);
			after = page.body.next;
			pages++;
		}
		expect(pages).toBe(3);
		expect(seen.map((n) => n.depth)).toEqual([0, 1, 2, 3, 4, 5, 6, 7]);
		for (const [i, n] of seen.entries()) {
			if (i > 0) expect(n.parent).toBe(seen[i - 1].id);
		}
		expect(seen[3]).toMatchObject({
			kind: "state",
			tool: "bash",
			args: { cmd: "step 2" },
			hits: 0,
		});
	});

	it("says 404 for the stats and graph of a task with nothing in it", async () => {
		const t = taskApi(keys.trainer, "nothing-here");
		expectError(await t.stats(), 404, "task_not_found");
		expectError(await t.graph(), 404, "task_not_found");
	});
});

describe("the edge cache's memory", () => {
	it("counts a Latin-1 string at a byte a character and any other at two", async () => {
		// 64 KiB: no entry over 4 KiB. 3,000 ASCII characters fit; 3,000
		// characters of Polish, at two bytes each, do not.
		const small: Env = {
			...env,
			EDGE_CACHE_BYTES: "65536" as string as Env["EDGE_CACHE_BYTES"],
		};
		const t = taskApi(keys.trainer, "edge-bytes", small);
		const ascii = bash("ascii");
		const wide = bash("wide");
		await t.record({
			from: ROOT_ID,
			calls: [run(ascii, "a".repeat(3000)), run(wide, "ł".repeat(3000))],
		});
		const where = async (call: typeof ascii, history: unknown[]) =>
			(await t.lookup({ history, call })).headers
				.get("server-timing")
				?.split(";")[0];
		expect(await where(ascii, [])).toBe("edge");
		expect(await where(wide, [ascii])).toBe("graph");
		expect(await where(wide, [ascii])).toBe("graph");
	});
});
