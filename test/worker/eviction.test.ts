/**
 * Budgets, eviction and the cron sweep, each with the invariant it keeps
 * (issue 4's faults 2, 4, 5, 7 and 10 among them).
 */
import { env } from "cloudflare:workers";
import { runDurableObjectAlarm, runInDurableObject } from "cloudflare:test";
import { beforeAll, describe, expect, it } from "vitest";
import type { EvictionLogPage } from "../../core/api.ts";
import { advanceClock, now } from "../../core/clock.ts";
import {
	graphOf,
	snapshotScores,
	snapshotsToEvict,
	subtreesToEvict,
	type EvictionNode,
} from "../../core/eviction.ts";
import { sweep } from "../../functions/scheduled.ts";
import {
	ROOT_ID,
	ROOT_KEY,
	api,
	bash,
	expectError,
	project,
	run,
	taskApi,
	snapshotBlob,
	stateAfter,
	runCron,
} from "./helpers.ts";

const node = (
	id: string,
	parent: string | null,
	over: Partial<EvictionNode> = {},
): EvictionNode => ({
	id,
	parent,
	depth: parent === null ? 0 : 1,
	kind: parent === null ? "root" : "state",
	execMs: 100,
	hits: 0,
	restores: 0,
	lastUsedAt: 0,
	outputBytes: 10,
	snapshotBytes: null,
	...over,
});

describe("eviction scores", () => {
	const t = 1_000_000;
	it("values a snapshot by the replay it saves, its use, its branches and its size", () => {
		const g = graphOf([
			node("r", null),
			node("cheap", "r", { execMs: 10, snapshotBytes: 1000 }),
			node("costly", "r", { execMs: 10_000, snapshotBytes: 1000 }),
			node("big", "r", { execMs: 10_000, snapshotBytes: 10_000_000 }),
			node("used", "r", {
				execMs: 10,
				snapshotBytes: 1000,
				hits: 50,
				lastUsedAt: t,
			}),
		]);
		const s = snapshotScores(g, t);
		expect(s.get("cheap")!).toBeLessThan(s.get("costly")!);
		expect(s.get("big")!).toBeLessThan(s.get("costly")!);
		expect(s.get("cheap")!).toBeLessThan(s.get("used")!);
	});

	it("evicts the least valuable snapshots first, never a pinned one, and stops within budget", () => {
		const g = graphOf([
			node("r", null),
			node("a", "r", { execMs: 10, snapshotBytes: 100 }),
			node("b", "r", { execMs: 20, snapshotBytes: 100 }),
			node("c", "r", { execMs: 5000, snapshotBytes: 100 }),
		]);
		expect(
			snapshotsToEvict(g, { snapshots: 1, snapshotBytes: 1e9 }, new Set(), t),
		).toEqual(["a", "b"]);
		expect(
			snapshotsToEvict(
				g,
				{ snapshots: 1, snapshotBytes: 1e9 },
				new Set(["a"]),
				t,
			),
		).toEqual(["b", "c"]);
		expect(
			snapshotsToEvict(g, { snapshots: 3, snapshotBytes: 1e9 }, new Set(), t),
		).toEqual([]);
	});

	it("removes whole subtrees, least value per byte first, keeping pinned paths and the root", () => {
		const g = graphOf([
			node("r", null),
			node("hot", "r", { hits: 100, lastUsedAt: t }),
			node("hot-child", "hot", { depth: 2, hits: 10, lastUsedAt: t }),
			node("cold", "r"),
			node("cold-child", "cold", { depth: 2 }),
			node("pinned", "r"),
		]);
		expect(
			subtreesToEvict(
				g,
				{ nodes: 4, outputBytes: 1e9 },
				new Set(["pinned"]),
				t,
			),
		).toEqual(["cold"]);
		const all = subtreesToEvict(
			g,
			{ nodes: 1, outputBytes: 1e9 },
			new Set(["pinned"]),
			t,
		);
		expect(all.sort()).toEqual(["cold", "hot"]);
	});
});

let keys: Awaited<ReturnType<typeof project>>;
beforeAll(async () => {
	keys = await project("evict");
});

/** The tasks of project `evict` that the tests below make. */
const FILE_TASKS = [
	"snapbudget",
	"leased",
	"nodes",
	"log",
	"retry",
	"twice",
	"orphans",
	"idle",
	"evicted-idle",
	"many",
];
const stub = (task: string) =>
	env.TASK_GRAPH.get(env.TASK_GRAPH.idFromName(`evict/${task}`));
const setBudgets = (json: object) =>
	api("PUT", "/v1/projects/evict/budgets", { key: keys.admin, json });

/** The key of branch `i`'s snapshot blob (see {@link branches}). */
const branchKey = (task: string, i: number) =>
	`snapshots/evict/${task}/${stateAfter(bash(`branch ${i}`))}/blob`;

/** Records `n` one-call branches from the root, each with a snapshot blob in R2. */
async function branches(
	task: string,
	n: number,
	execMs: (i: number) => number,
) {
	const t = taskApi(keys.trainer, task);
	const states: string[] = [];
	for (let i = 0; i < n; i++) {
		const ref = await snapshotBlob(
			"evict",
			task,
			stateAfter(bash(`branch ${i}`)),
			100,
		);
		const r = await t.record({
			from: ROOT_ID,
			calls: [
				{ ...run(bash(`branch ${i}`), `out ${i}`, execMs(i)), snapshot: ref },
			],
		});
		states.push(r.body.state);
	}
	return { t, states };
}

describe("budgets in a task graph", () => {
	it("keeps a project's budget overrides, and only its admin may set them", async () => {
		const r = await setBudgets({ snapshots: 50, nodes: 1000 });
		expect(r.status).toBe(200);
		expect(r.body).toMatchObject({ snapshots: 50, nodes: 1000 });
		expect(r.body.outputBytes).toBe(Number(env.BUDGET_OUTPUT_BYTES));
		expectError(
			await api("PUT", "/v1/projects/evict/budgets", {
				key: keys.trainer,
				json: { nodes: 1 },
			}),
			403,
			"forbidden",
		);
		expectError(await setBudgets({ nodes: 0 }), 400, "invalid_request");
		expectError(await setBudgets({ nodes: "many" }), 400, "invalid_request");
		const other = await project("evict-other");
		expectError(
			await api("PUT", "/v1/projects/evict/budgets", {
				key: other.admin,
				json: { nodes: 5 },
			}),
			404,
			"project_not_found",
		);
		expect(
			(await api("GET", "/v1/projects/evict/budgets", { key: ROOT_KEY })).body
				.snapshots,
		).toBe(50);
	});

	it("evicts the least valuable snapshots past the budget, keeping outputs and deleting blobs", async () => {
		await setBudgets({ snapshots: 2, nodes: 1000 });
		const { t, states } = await branches(
			"snapbudget",
			4,
			(i) => [10, 5000, 20, 9000][i],
		);
		// Each record over budget arms the alarm at once; make sure it has run.
		await runDurableObjectAlarm(stub("snapbudget"));
		const stats = (await t.stats()).body;
		expect(stats.snapshots).toBe(2);
		expect(stats.evictions.snapshot_budget).toEqual({ count: 2, bytes: 200 });
		const g = (await t.graph()).body.nodes;
		const kept = g
			.filter((n: { snapshot: unknown }) => n.snapshot !== null)
			.map((n: { id: string }) => n.id);
		expect(kept.sort()).toEqual([states[1], states[3]].sort());
		// Outputs stay valid forever: every branch still hits.
		for (let i = 0; i < 4; i++) {
			expect(
				(await t.lookup({ history: [], call: bash(`branch ${i}`) })).body
					.output,
			).toBe(`out ${i}`);
		}
		expect(await env.BLOBS.head(branchKey("snapbudget", 0))).toBeNull();
		expect(await env.BLOBS.head(branchKey("snapbudget", 1))).not.toBeNull();
		// The graph export shows the scores it decided by.
		const scored = g.filter((n: { kind: string }) => n.kind !== "root");
		for (const n of scored) expect(typeof n.score).toBe("number");
		// The log says which snapshots went; their nodes stay.
		const log = (await t.evictions()).body;
		expect(
			log.evictions.map((e: { id: string; reason: string; tool: string }) => [
				e.id,
				e.reason,
				e.tool,
			]),
		).toEqual(
			expect.arrayContaining([
				[states[0], "snapshot_budget", "bash"],
				[states[2], "snapshot_budget", "bash"],
			]),
		);
		expect(log).toMatchObject({ next: null, dropped: 0 });
		expect(log.evictions).toHaveLength(2);
	});

	it("never evicts a leased snapshot, and evicts it once the lease expires (faults 4 and 10)", async () => {
		await setBudgets({ snapshots: 100, nodes: 1000 });
		const { t, states } = await branches("leased", 2, () => 100);
		const lease = await t.lease({ state: states[0], ttlMs: 1000 });
		const none = (await setBudgets({ snapshots: 0 })).body;
		// The restore is under way (the lease is held) when eviction runs.
		expect((await stub("leased").enforce(none)).snapshots).toBe(1);
		let g = (await t.graph()).body.nodes;
		expect(
			g.find((n: { id: string }) => n.id === states[0]).snapshot,
		).not.toBeNull();
		expect(
			g.find((n: { id: string }) => n.id === states[1]).snapshot,
		).toBeNull();
		expect(await env.BLOBS.head(branchKey("leased", 0))).not.toBeNull();

		// The client died holding it: the lease expires through the alarm.
		advanceClock(1001);
		expect((await stub("leased").enforce(none)).snapshots).toBe(1);
		g = (await t.graph()).body.nodes;
		expect(
			g.filter((n: { snapshot: unknown }) => n.snapshot !== null),
		).toHaveLength(0);
		expectError(await t.renew(lease.body.id), 409, "lease_expired");
	});

	it("removes whole subtrees past the node budget; a stale cursor is 409 and the full history still works (fault 7)", async () => {
		await setBudgets({ snapshots: 100, nodes: 4 });
		const t = taskApi(keys.trainer, "nodes");
		const hot = await t.record({
			from: ROOT_ID,
			calls: [run(bash("hot"), "h", 5000), run(bash("hot2"), "h2", 5000)],
		});
		for (let i = 0; i < 5; i++)
			await t.lookup({ history: [], call: bash("hot") });
		const cold = await t.record({
			from: ROOT_ID,
			calls: [run(bash("cold"), "c", 1), run(bash("cold2"), "c2", 1)],
		});
		await runDurableObjectAlarm(stub("nodes"));
		const stats = (await t.stats()).body;
		expect(stats.nodes).toBeLessThanOrEqual(4);
		expect(stats.evictions.node_budget.count).toBeGreaterThanOrEqual(1);
		expect(
			(await t.lookup({ history: [bash("hot")], call: bash("hot2") })).body
				.status,
		).toBe("hit");
		expectError(
			await t.lookup({ cursor: cold.body.state, call: bash("x") }),
			409,
			"stale_cursor",
		);
		const full = await t.lookup({
			history: [bash("cold"), bash("cold2")],
			call: bash("x"),
		});
		expect(full.body).toMatchObject({ status: "miss", resume: ROOT_ID });
		expect(
			full.body.replay.map((c: { args: { cmd: string } }) => c.args.cmd),
		).toEqual(["cold", "cold2"]);
		expect(hot.body.state).not.toBe(cold.body.state);
		// The log names every node that went, and nothing else.
		const recorded = [
			stateAfter(bash("hot")),
			hot.body.state,
			stateAfter(bash("cold")),
			cold.body.state,
		];
		const kept = new Set(
			(await t.graph()).body.nodes.map((n: { id: string }) => n.id),
		);
		const log = (await t.evictions()).body.evictions;
		expect(log.map((e: { id: string }) => e.id).sort()).toEqual(
			recorded.filter((id) => !kept.has(id)).sort(),
		);
		expect(log).toHaveLength(stats.evictions.node_budget.count);
		for (const e of log) {
			expect(e).toMatchObject({ reason: "node_budget", tool: "bash" });
			expect(e.at).toBeLessThanOrEqual(now());
		}
	});

	it("evicts more nodes and snapshots in one pass than a statement binds ids", async () => {
		// A Durable Object's SQLite takes 100 bound parameters a statement.
		await setBudgets({ snapshots: 1000, nodes: 1000 });
		const t = taskApi(keys.trainer, "many");
		const calls = [];
		let state = ROOT_ID;
		for (let i = 0; i < 150; i++) {
			const call = bash(`m${i}`);
			state = stateAfter(call, state);
			calls.push({
				...run(call, "o", 1),
				// The first 120 with a snapshot each.
				...(i < 120
					? { snapshot: await snapshotBlob("evict", "many", state, 10) }
					: {}),
			});
		}
		await t.record({ from: ROOT_ID, calls });
		await runDurableObjectAlarm(stub("many"));
		expect((await t.stats()).body.snapshots).toBe(120);
		const none = await stub("many").enforce(
			(await setBudgets({ snapshots: 0, nodes: 1000 })).body,
		);
		expect(none.snapshots).toBe(120);
		const evicted = await stub("many").enforce(
			(await setBudgets({ snapshots: 1000, nodes: 2 })).body,
		);
		expect(evicted.nodes).toBe(149);
		const stats = (await t.stats()).body;
		expect(stats).toMatchObject({ nodes: 2, snapshots: 0 });
		const log = (await t.evictions("?limit=1000")).body;
		// The test Worker's log keeps 6 rows; the rest are counted.
		expect(log.evictions.length + log.dropped).toBe(120 + 149);
	});

	it("keeps a log of what eviction took, in pages, letting the oldest go past its size and counting them", async () => {
		await setBudgets({ snapshots: 100, nodes: 3 });
		const t = taskApi(keys.trainer, "log");
		// Each branch is colder than the last, so the newest stays and the
		// others go in the order they came.
		for (let i = 0; i < 10; i++) {
			await t.record({ from: ROOT_ID, calls: [run(bash(`b${i}`), "o", 1)] });
			await runDurableObjectAlarm(stub("log"));
		}
		const stats = (await t.stats()).body;
		const evicted = stats.evictions.node_budget.count;
		expect(evicted).toBeGreaterThan(6);
		// Read in pages of 2: the same as one page, in the order they went.
		const whole = (await t.evictions()).body;
		const paged: { seq: number }[] = [];
		let after: number | null = 0;
		while (after !== null) {
			const page: EvictionLogPage = (
				await t.evictions(`?after=${after}&limit=2`)
			).body;
			expect(page.evictions.length).toBeLessThanOrEqual(2);
			paged.push(...page.evictions);
			after = page.next;
		}
		expect(paged).toEqual(whole.evictions);
		const seqs = whole.evictions.map((e: { seq: number }) => e.seq);
		expect(seqs).toEqual([...seqs].sort((a, b) => a - b));
		// The test Worker keeps 6 rows (EVICTION_LOG_ROWS): the rest are
		// counted, and together they are every node evicted.
		expect(whole.evictions).toHaveLength(6);
		expect(whole.dropped + whole.evictions.length).toBe(evicted);
		// What the log names is gone from the graph. (Its outputs may still
		// be served from the Worker's memory: they never change.)
		const kept = new Set(
			(await t.graph()).body.nodes.map((n: { id: string }) => n.id),
		);
		for (const e of whole.evictions) expect(kept.has(e.id)).toBe(false);
		// Any role of the project reads it; another project, or a task that
		// holds nothing, gets 404; the root key sees no task.
		expect((await taskApi(keys.host, "log").evictions()).status).toBe(200);
		const other = await project("evict-log-other");
		expectError(
			await taskApi(other.trainer, "log").evictions(),
			404,
			"task_not_found",
		);
		expectError(
			await taskApi(keys.trainer, "never").evictions(),
			404,
			"task_not_found",
		);
		expectError(await taskApi(ROOT_KEY, "log").evictions(), 403, "forbidden");
		// Reads leave the task's index write pending: let it land now, not in
		// the middle of a later test's sweep, which counts indexed tasks.
		for (let i = 0; i < 10 && (await runDurableObjectAlarm(stub("log"))); i++);
		expect(await runDurableObjectAlarm(stub("log"))).toBe(false);
	});

	// Found by the soak: a client retrying a record whose answer it lost
	// re-attached a snapshot that eviction had deleted meanwhile.
	it("never re-attaches an evicted snapshot when a record is retried", async () => {
		await setBudgets({ snapshots: 100, nodes: 1000 });
		const t = taskApi(keys.trainer, "retry");
		const first = await t.record({
			from: ROOT_ID,
			calls: [run(bash("a"), "1", 1)],
		});
		const state = first.body.state;
		const up = await api(
			"PUT",
			`/v1/tasks/retry/snapshots/${state}?driver=workspace`,
			{
				key: keys.host,
				body: "blob",
			},
		);
		const withSnap = {
			from: ROOT_ID,
			calls: [{ ...run(bash("a"), "1", 1), snapshot: up.body }],
		};
		expect((await t.record(withSnap)).body.results[0].status).toBe("exists");
		await branches("retry", 1, () => 9000);
		const one = (await setBudgets({ snapshots: 1 })).body;
		expect((await stub("retry").enforce(one)).snapshots).toBe(1);
		expect(await env.BLOBS.head(up.body.key)).toBeNull();

		// The retry: same record, same ref. The Worker finds no blob behind
		// the ref: the call stands as recorded, without a snapshot, and the
		// answer says so.
		expect((await t.record(withSnap)).body.results[0]).toMatchObject({
			status: "exists",
			snapshot: "missing",
		});
		const node = (await t.graph()).body.nodes.find(
			(n: { id: string }) => n.id === state,
		);
		expect(node.snapshot).toBeNull();
		const miss = await t.lookup({ history: [bash("a")], call: bash("next") });
		expect(miss.body).toMatchObject({
			snapshot: null,
			lease: null,
			resume: ROOT_ID,
		});
	});

	it("gives the same end state when the eviction alarm runs twice (fault 5)", async () => {
		await setBudgets({ snapshots: 1, nodes: 1000 });
		const { t } = await branches("twice", 3, (i) => i * 100 + 1);
		await runDurableObjectAlarm(stub("twice"));
		const once = {
			stats: (await t.stats()).body,
			graph: (await t.graph()).body,
		};
		await runInDurableObject(stub("twice"), (g) => g.alarm());
		expect({
			stats: (await t.stats()).body,
			graph: (await t.graph()).body,
		}).toEqual(once);
	});
});

describe("the cron sweep", () => {
	it("deletes blobs no node points at after the grace period, and keeps those in use (fault 2)", async () => {
		await setBudgets({ snapshots: 100, nodes: 1000 });
		const t = taskApi(keys.trainer, "orphans");
		const used = await snapshotBlob(
			"evict",
			"orphans",
			stateAfter(bash("a")),
			3,
		);
		await t.record({
			from: ROOT_ID,
			calls: [{ ...run(bash("a"), "1"), snapshot: used }],
		});
		// A host uploaded, then crashed before recording.
		const up = await api(
			"PUT",
			`/v1/tasks/orphans/snapshots/${"f".repeat(64)}?driver=workspace`,
			{ key: keys.host, body: "lost" },
		);
		expect(up.status).toBe(201);
		advanceClock(3000);
		await runDurableObjectAlarm(stub("orphans"));

		await runCron();
		expect(await env.BLOBS.head(up.body.key)).not.toBeNull();
		advanceClock(Number(env.ORPHAN_GRACE_MS) + 1);
		await runCron();
		expect(await env.BLOBS.head(up.body.key)).toBeNull();
		expect(await env.BLOBS.head(used.key)).not.toBeNull();
		expect((await t.stats()).body.evictions.orphan).toEqual({
			count: 1,
			bytes: 4,
		});
	});

	it("counts an eviction as no use: a task evicted while idle still expires on time", async () => {
		await setBudgets({ snapshots: 100, nodes: 1000 });
		const t = taskApi(keys.trainer, "evicted-idle");
		await t.record({
			from: ROOT_ID,
			calls: [run(bash("x1"), "1", 1), run(bash("x2"), "2", 1)],
		});
		await runDurableObjectAlarm(stub("evicted-idle"));
		const ttl = Number(env.IDLE_TASK_TTL_MS);
		// Most of the TTL later, a lower budget evicts part of the task.
		advanceClock(ttl - 10_000);
		const evicted = await stub("evicted-idle").enforce(
			(await setBudgets({ nodes: 2 })).body,
		);
		expect(evicted.nodes).toBe(1);
		for (
			let i = 0;
			i < 10 && (await runDurableObjectAlarm(stub("evicted-idle")));
			i++
		);
		// Past the TTL since the record, not since the eviction: deleted.
		advanceClock(10_001);
		const res = await stub("evicted-idle").sweep({
			budgets: (await setBudgets({ nodes: 1000 })).body,
			idleTtlMs: ttl,
			orphanGraceMs: Number(env.ORPHAN_GRACE_MS),
		});
		expect(res.deleted).toBe(true);
		expectError(await t.stats(), 404, "task_not_found");
	});

	it("deletes a task idle past the TTL with its blobs, and is safe to run twice at once", async () => {
		const t = taskApi(keys.trainer, "idle");
		const big = "z".repeat(5000);
		await t.record({ from: ROOT_ID, calls: [run(bash("a"), big)] });
		advanceClock(3000);
		await runDurableObjectAlarm(stub("idle"));
		expect(
			(await env.BLOBS.list({ prefix: "outputs/evict/idle/" })).objects,
		).toHaveLength(1);

		advanceClock(Number(env.IDLE_TASK_TTL_MS) + 1);
		const indexed = async () =>
			(await env.DB.prepare("select count(*) as n from tasks").first<{
				n: number;
			}>())!.n;
		// Index writes still pending land INDEX_FLUSH_DELAY_MS after a use, in
		// real time: in the middle of the sweeps they would upset the count.
		for (const name of FILE_TASKS)
			for (let i = 0; i < 10 && (await runDurableObjectAlarm(stub(name))); i++);
		const before = await indexed();
		const [a, b] = await Promise.all([sweep(env, now()), sweep(env, now())]);
		// Every task idle by now (this file's others too) is deleted by one
		// of the two sweeps; the other finds nothing left to delete.
		expect(a.deleted + b.deleted).toBe(before - (await indexed()));
		expectError(await t.stats(), 404, "task_not_found");
		expect(
			(await env.BLOBS.list({ prefix: "outputs/evict/idle/" })).objects,
		).toHaveLength(0);
		const listed = await api("GET", "/v1/tasks", { key: keys.trainer });
		expect(
			listed.body.tasks.map((x: { task: string }) => x.task),
		).not.toContain("idle");
		// A deleted task starts over cleanly.
		expect((await t.lookup({ history: [], call: bash("a") })).body.status).toBe(
			"miss",
		);
	});
});

describe("project quotas", () => {
	/**
	 * A project with `budgets` and one task recorded and indexed: the graph
	 * writes the task index from its alarm, and the Worker reads it through
	 * a 10 s cache.
	 */
	async function indexedTask(
		name: string,
		budgets: Record<string, number>,
		task: string,
		output: string,
	) {
		const p = await project(name);
		await api("PUT", `/v1/projects/${name}/budgets`, {
			key: p.admin,
			json: budgets,
		});
		const t = taskApi(p.trainer, task);
		await t.record({ from: ROOT_ID, calls: [run(bash("a"), output)] });
		advanceClock(3000);
		await runDurableObjectAlarm(
			env.TASK_GRAPH.get(env.TASK_GRAPH.idFromName(`${name}/${task}`)),
		);
		advanceClock(11_000);
		return { p, t };
	}

	it("refuses a new task past the project's task quota with 403, writing nothing", async () => {
		const { p, t: first } = await indexedTask(
			"quota",
			{ tasks: 1 },
			"one",
			"1",
		);
		const second = taskApi(p.trainer, "two");
		expectError(
			await second.record({ from: ROOT_ID, calls: [run(bash("a"), "1")] }),
			403,
			"quota_exceeded",
		);
		expectError(await second.stats(), 404, "task_not_found");
		for (const cmd of ["b", "c"]) {
			expect(
				(await first.record({ from: ROOT_ID, calls: [run(bash(cmd), cmd)] }))
					.status,
			).toBe(200);
		}
	});

	it("refuses any record once the project's bytes are spent, and still answers lookups", async () => {
		const { p, t } = await indexedTask(
			"quota-bytes",
			{ projectBytes: 10 },
			"big",
			"0123456789ab",
		);
		for (const task of ["big", "other"]) {
			const r = await taskApi(p.trainer, task).record({
				from: ROOT_ID,
				calls: [run(bash("b"), "2")],
			});
			expectError(r, 403, "quota_exceeded");
			expect(r.body.error.message).toMatch(/bytes/);
		}
		expect((await t.stats()).body.nodes).toBe(2);
		expect(
			(await t.lookup({ history: [], call: bash("a") })).body,
		).toMatchObject({ status: "hit", output: "0123456789ab" });
	});
});
