/**
 * Requests that interleave inside one task graph: whatever runs while
 * another request awaits R2, D1 or a host, and restarts between a write and
 * the alarm that follows it (invariants 3 and 4). Where the interleaving
 * cannot be produced otherwise, a test double of R2 or of a host holds one
 * request at a chosen await until the test lets it go. Every request goes
 * with the Worker's edge cache off, so that a lookup asks the task graph,
 * not the Worker's memory of what it recorded.
 */
import { env } from "cloudflare:workers";
import { abortAllDurableObjects, runDurableObjectAlarm } from "cloudflare:test";
import { afterEach, beforeAll, describe, expect, it, vi } from "vitest";
import { advanceClock } from "../../core/clock.ts";
import type { Budgets } from "../../core/eviction.ts";
import { pathIds } from "../../core/ids.ts";
import type { SweepInput } from "../../durable-objects/task-graph.ts";
import {
	NO_EDGE,
	ROOT_ID,
	api,
	bash,
	expectError,
	project,
	run,
	taskApi,
} from "./helpers.ts";

let keys: Awaited<ReturnType<typeof project>>;
beforeAll(async () => {
	keys = await project("races");
});
afterEach(() => {
	vi.restoreAllMocks();
});

const stub = (task: string) =>
	env.TASK_GRAPH.get(env.TASK_GRAPH.idFromName(`races/${task}`));

const IDLE_MS = Number(env.IDLE_TASK_TTL_MS);

const budgets = (over: Partial<Budgets> = {}): Budgets => ({
	snapshots: 1000,
	snapshotBytes: 1e10,
	nodes: 200_000,
	outputBytes: 1e9,
	tasks: 1e5,
	projectBytes: 1e12,
	...over,
});

const sweepInput = (): SweepInput => ({
	budgets: budgets(),
	idleTtlMs: IDLE_MS,
	orphanGraceMs: Number(env.ORPHAN_GRACE_MS),
});

/** Larger than the tests' inline limit (1 KiB): it goes to R2. */
const BIG = "o".repeat(4000);

/**
 * A point the task graph stops at until the test opens it: `reached`
 * resolves once a request has got there. Both sides poll plain flags: a
 * promise made in the test and awaited in the object (or the other way
 * round) crosses request contexts, and the runtime then never delivered a
 * later test's reply after abortAllDurableObjects.
 */
function gate() {
	const state = { arrived: false, isOpen: false };
	const until = async (done: () => boolean) => {
		while (!done()) await new Promise((r) => setTimeout(r, 1));
	};
	return {
		reached: () => until(() => state.arrived),
		opened: () => until(() => state.isOpen),
		arrive: () => void (state.arrived = true),
		open: () => void (state.isOpen = true),
	};
}

/** R2's put, holding a put of a key under `prefix` (after it landed) at `g`. */
function holdPuts(prefix: string, g: ReturnType<typeof gate>) {
	const put = env.BLOBS.put.bind(env.BLOBS);
	vi.spyOn(env.BLOBS, "put").mockImplementation(async (key, value, opts) => {
		const r = await put(key, value, opts);
		if (key.startsWith(prefix)) {
			g.arrive();
			await g.opened();
		}
		return r;
	});
}

/**
 * Waits for `p` a while, and says whether it answered: only to give a
 * request that is not held every chance to finish first (time the wrong
 * code would need to show its fault), never to wait for the right one.
 */
async function answersSoon(p: Promise<unknown>): Promise<boolean> {
	const soon = new Promise((r) => setTimeout(r, 300, "held"));
	return (await Promise.race([p.then(() => "answered"), soon])) === "answered";
}

/** The recorded calls, with their ids, as the Worker hands them to the object. */
function keyed(
	from: string,
	calls: { tool: string; args: unknown; mutates: boolean; output: string }[],
) {
	const steps = pathIds(calls, from);
	return calls.map((c, i) => ({
		...c,
		id: steps[i].id,
		exitCode: 0,
		execMs: 10,
	}));
}

describe("idle-task deletion", () => {
	it("holds a record sent during an idle task's deletion until it is done, and keeps it", async () => {
		const t = taskApi(keys.trainer, "idle-race", NO_EDGE);
		await t.record({ from: ROOT_ID, calls: [run(bash("old"), BIG)] });
		advanceClock(IDLE_MS + 1);

		// The deletion stops at its first R2 listing.
		const g = gate();
		const list = env.BLOBS.list.bind(env.BLOBS);
		vi.spyOn(env.BLOBS, "list").mockImplementation(async (opts) => {
			g.arrive();
			await g.opened();
			return list(opts);
		});
		const sweeping = stub("idle-race").sweep(sweepInput());
		await g.reached();
		const rec = t.record({ from: ROOT_ID, calls: [run(bash("new"), "n")] });
		const early = await answersSoon(rec);
		g.open();
		const [swept, reply] = await Promise.all([sweeping, rec]);

		expect(swept.deleted).toBe(true);
		// Acknowledged, so kept: it landed in the task started afresh.
		expect(reply.status).toBe(200);
		expect(
			(await t.lookup({ history: [], call: bash("new") })).body,
		).toMatchObject({ status: "hit", output: "n" });
		expect(
			(await t.lookup({ history: [], call: bash("old") })).body.status,
		).toBe("miss");
		expect(early).toBe(false);
	});

	it("deletes an idle task once when two sweeps run at once", async () => {
		const t = taskApi(keys.trainer, "idle-twice", NO_EDGE);
		await t.record({ from: ROOT_ID, calls: [run(bash("old"), BIG)] });
		advanceClock(IDLE_MS + 1);

		const g = gate();
		let listings = 0;
		const list = env.BLOBS.list.bind(env.BLOBS);
		vi.spyOn(env.BLOBS, "list").mockImplementation(async (opts) => {
			listings++;
			g.arrive();
			await g.opened();
			return list(opts);
		});
		const a = stub("idle-twice").sweep(sweepInput());
		const b = stub("idle-twice").sweep(sweepInput());
		await g.reached();
		// Time for the second to get as far as the first, if it can.
		await answersSoon(
			(async () => {
				while (listings < 2) await new Promise((r) => setTimeout(r, 1));
			})(),
		);
		g.open();
		const swept = await Promise.all([a, b]);
		expect(swept.filter((s) => s.deleted)).toHaveLength(1);
		expect((await t.stats()).status).toBe(404);
	});

	it("does not delete an idle task while a record into it is under way", async () => {
		const t = taskApi(keys.trainer, "idle-busy", NO_EDGE);
		await t.record({ from: ROOT_ID, calls: [run(bash("old"), "o")] });
		advanceClock(IDLE_MS + 1);

		const g = gate();
		holdPuts("outputs/races/idle-busy/", g);
		const rec = t.record({ from: ROOT_ID, calls: [run(bash("new"), BIG)] });
		// Its blob is in R2; its row is not written yet.
		await g.reached();
		const swept = await stub("idle-busy").sweep(sweepInput());
		g.open();
		const reply = await rec;

		expect(swept.deleted).toBe(false);
		expect(reply.status).toBe(200);
		expect(
			(await t.lookup({ history: [], call: bash("new") })).body,
		).toMatchObject({ status: "hit", output: BIG });
		// And the record made the task used: the next sweep keeps it too.
		expect((await stub("idle-busy").sweep(sweepInput())).deleted).toBe(false);
	});
});

describe("shared blobs", () => {
	it("keeps a snapshot blob another node points at, and the lease on that node", async () => {
		const t = taskApi(keys.trainer, "shared-snapshot", NO_EDGE);
		const ref = {
			driver: "workspace",
			key: `snapshots/races/shared-snapshot/${"a".repeat(64)}/one`,
			bytes: 4,
		};
		await env.BLOBS.put(ref.key, "snap");
		// The Worker refuses a ref of another state than the call's, so no two
		// nodes get one blob through it; the task graph keeps its own guard,
		// recorded into straight here.
		const graph = stub("shared-snapshot");
		const scope = { project: "races", task: "shared-snapshot" };
		const recordOne = (call: ReturnType<typeof bash>, output: string) =>
			graph.record(scope, {
				from: ROOT_ID,
				calls: [
					{
						tool: call.tool,
						args: call.args ?? null,
						mutates: true,
						id: pathIds([call], ROOT_ID)[0].id,
						output,
						exitCode: 0,
						execMs: 10,
						snapshot: ref,
					},
				],
				inlineMaxBytes: 1024,
			});
		expect((await recordOne(bash("a"), "1")).ok).toBe(true);
		const b = await recordOne(bash("b"), "2");
		if (!b.ok) throw new Error(b.message);
		const lease = await t.lease({ state: b.value.state, ttlMs: 60_000 });
		expect(lease.status).toBe(201);

		// One snapshot over budget: a's goes (b's is leased).
		const one = await stub("shared-snapshot").enforce(
			budgets({ snapshots: 1 }),
		);
		expect(one.snapshots).toBe(1);
		expect(await env.BLOBS.head(ref.key)).not.toBeNull();
		const miss = await t.lookup({
			history: [bash("b")],
			call: bash("c"),
			lease: false,
		});
		expect(miss.body.snapshot).toMatchObject({ key: ref.key });

		// Once no node points at it, it goes.
		expect((await t.release(lease.body.id)).status).toBe(200);
		const none = await stub("shared-snapshot").enforce(
			budgets({ snapshots: 0 }),
		);
		expect(none.snapshots).toBe(1);
		expect(await env.BLOBS.head(ref.key)).toBeNull();
	});

	it("never deletes an output blob a record under way is writing", async () => {
		const t = taskApi(keys.trainer, "writing-output", NO_EDGE);
		await t.record({ from: ROOT_ID, calls: [run(bash("first"), BIG)] });

		const g = gate();
		holdPuts("outputs/races/writing-output/", g);
		// The same output under another call: the same content-addressed key.
		const rec = t.record({ from: ROOT_ID, calls: [run(bash("second"), BIG)] });
		await g.reached();
		// Eviction drops `first`, the only node that points at the key so far.
		const evicted = await stub("writing-output").enforce(budgets({ nodes: 1 }));
		expect(evicted.nodes).toBe(1);
		g.open();
		expect((await rec).status).toBe(200);

		expect(
			(await t.lookup({ history: [], call: bash("second") })).body,
		).toMatchObject({ status: "hit", output: BIG });
		const listed = await env.BLOBS.list({
			prefix: "outputs/races/writing-output/",
		});
		expect(listed.objects).toHaveLength(1);
	});

	it("puts an output blob only once a deletion of the same key in flight has landed", async () => {
		const t = taskApi(keys.trainer, "deleting-output", NO_EDGE);
		await t.record({ from: ROOT_ID, calls: [run(bash("first"), BIG)] });

		// Eviction's deletion of the key is sent but held before R2 acts on it.
		const g = gate();
		const del = env.BLOBS.delete.bind(env.BLOBS);
		vi.spyOn(env.BLOBS, "delete").mockImplementation(async (k) => {
			g.arrive();
			await g.opened();
			return del(k);
		});
		const evicting = stub("deleting-output").enforce(budgets({ nodes: 1 }));
		await g.reached();
		const rec = t.record({ from: ROOT_ID, calls: [run(bash("second"), BIG)] });
		await answersSoon(rec);
		g.open();
		expect((await evicting).nodes).toBe(1);
		expect((await rec).status).toBe(200);

		expect(
			(await t.lookup({ history: [], call: bash("second") })).body,
		).toMatchObject({ status: "hit", output: BIG });
		const listed = await env.BLOBS.list({
			prefix: "outputs/races/deleting-output/",
		});
		expect(listed.objects).toHaveLength(1);
	});
});

describe("a record's transaction", () => {
	it("stores an output too large for a row in R2, whatever the inline threshold", async () => {
		const huge = "h".repeat(2.5 * 1024 * 1024);
		const calls = keyed(ROOT_ID, [
			{ tool: "bash", args: { cmd: "huge" }, mutates: true, output: huge },
		]);
		const r = await stub("huge-output").record(
			{ project: "races", task: "huge-output" },
			{ from: ROOT_ID, calls, inlineMaxBytes: 16 * 1024 * 1024 },
		);
		expect(r).toMatchObject({ ok: true });
		const hit = await taskApi(keys.trainer, "huge-output", NO_EDGE).lookup({
			history: [],
			call: bash("huge"),
		});
		expect(hit.body.status).toBe("hit");
		expect(hit.body.output.length).toBe(huge.length);
	});

	it("leaves the index as it was when the transaction fails part way", async () => {
		// The second call's args make a row past SQLite's 2 MB: the insert
		// throws after the first call's insert.
		const calls = keyed(ROOT_ID, [
			{ tool: "bash", args: { cmd: "small" }, mutates: true, output: "s" },
			{
				tool: "bash",
				args: { cmd: "x".repeat(3 * 1024 * 1024) },
				mutates: true,
				output: "t",
			},
		]);
		const graph = stub("rolled-back");
		const r = await graph.record(
			{ project: "races", task: "rolled-back" },
			{ from: ROOT_ID, calls, inlineMaxBytes: 1024 },
		);
		expect(r).toMatchObject({ ok: false, status: 413, code: "too_large" });
		// Neither call is held: the lookup is a plain miss, not a 500.
		const t = taskApi(keys.trainer, "rolled-back", NO_EDGE);
		expect(
			(await t.lookup({ history: [], call: bash("small") })).body.status,
		).toBe("miss");
		const ok = await t.record({
			from: ROOT_ID,
			calls: [run(bash("small"), "s")],
		});
		expect(ok.body.results[0].status).toBe("recorded");
		expect((await t.stats()).body.nodes).toBe(2);
	});

	it("answers 409 when `from` is evicted while the record awaits R2", async () => {
		const t = taskApi(keys.trainer, "from-evicted", NO_EDGE);
		const base = await t.record({
			from: ROOT_ID,
			calls: [run(bash("base"), "b")],
		});
		const g = gate();
		holdPuts("outputs/races/from-evicted/", g);
		const rec = t.record({
			from: base.body.state,
			calls: [run(bash("next"), BIG)],
		});
		await g.reached();
		expect(
			(await stub("from-evicted").enforce(budgets({ nodes: 1 }))).nodes,
		).toBe(1);
		g.open();
		expectError(await rec, 409, "unknown_state");
		expect((await t.stats()).body.nodes).toBe(1);
	});

	it("answers a retryable 503 when a call with a large output is evicted while the record awaits R2", async () => {
		const graph = stub("held-evicted");
		const scope = { project: "races", task: "held-evicted" };
		// Over a row's 1 MiB: such an output only ever goes to R2.
		const huge = "h".repeat(1_100_000);
		const [x, y] = keyed(ROOT_ID, [
			{ tool: "bash", args: { cmd: "x" }, mutates: true, output: huge },
			{ tool: "bash", args: { cmd: "y" }, mutates: true, output: BIG },
		]);
		const input = { from: ROOT_ID, calls: [x], inlineMaxBytes: 1024 };
		expect((await graph.record(scope, input)).ok).toBe(true);
		// x is held when the run [x, y] writes its blobs, so x gets none.
		const g = gate();
		holdPuts("outputs/races/held-evicted/", g);
		const rec = graph.record(scope, { ...input, calls: [x, y] });
		await g.reached();
		expect((await graph.enforce(budgets({ nodes: 1 }))).nodes).toBe(1);
		g.open();
		const r = await rec;
		expect(r).toMatchObject({
			ok: false,
			status: 503,
			code: "storage_unavailable",
		});
		// Nothing of the run was recorded, and a retry records it whole.
		expect((await graph.stats(scope))!.nodes).toBe(1);
		vi.restoreAllMocks();
		const again = await graph.record(scope, { ...input, calls: [x, y] });
		expect(again.ok && again.value.results.map((res) => res.status)).toEqual([
			"recorded",
			"recorded",
		]);
	});
});

describe("restarts", () => {
	it("keeps a task recorded just before a restart from the idle sweep", async () => {
		const t = taskApi(keys.trainer, "restart-idle", NO_EDGE);
		await t.record({ from: ROOT_ID, calls: [run(bash("a"), "1")] });
		// The alarm writes the task index and its last use.
		advanceClock(3000);
		await runDurableObjectAlarm(stub("restart-idle"));
		advanceClock(IDLE_MS - 10_000);
		const b = await t.record({ from: ROOT_ID, calls: [run(bash("b"), "2")] });
		expect(b.status).toBe(200);
		// Restarted before the alarm that would write the index again.
		await abortAllDurableObjects();
		advanceClock(20_000);

		expect((await stub("restart-idle").sweep(sweepInput())).deleted).toBe(
			false,
		);
		expect(
			(await t.lookup({ history: [], call: bash("b") })).body,
		).toMatchObject({ status: "hit", output: "2" });
	});

	it("indexes a task recorded just before a restart, so the cron visits it", async () => {
		// Alarms armed from here on are due a minute ahead of the real clock:
		// none runs on its own before the restart.
		advanceClock(60_000);
		const t = taskApi(keys.trainer, "restart-index", NO_EDGE);
		await t.record({ from: ROOT_ID, calls: [run(bash("a"), "1")] });
		const indexed = () =>
			env.DB.prepare(
				"select nodes from tasks where project_id = 'races' and task = 'restart-index'",
			).first<{ nodes: number }>();
		expect(await indexed()).toBeNull();
		await abortAllDurableObjects();
		// The alarm the record armed outlives the restart; the memory that
		// the index was behind does not, and the start finds it again.
		expect(await runDurableObjectAlarm(stub("restart-index"))).toBe(true);
		expect(await indexed()).toEqual({ nodes: 2 });
	});

	it("evicts after a restart by the budgets the last record brought", async () => {
		const p = await project("races-budgets");
		const set = await api("PUT", "/v1/projects/races-budgets/budgets", {
			key: p.admin,
			json: { nodes: 2 },
		});
		expect(set.status).toBe(200);
		// Alarms armed from here on are due a minute ahead of the real clock:
		// none runs on its own before the restart.
		advanceClock(60_000);
		const t = taskApi(p.trainer, "over", NO_EDGE);
		await t.record({
			from: ROOT_ID,
			calls: [run(bash("a"), "1"), run(bash("b"), "2")],
		});
		// Over budget (3 nodes): the record armed an eviction, then a restart.
		await abortAllDurableObjects();
		const graph = env.TASK_GRAPH.get(
			env.TASK_GRAPH.idFromName("races-budgets/over"),
		);
		expect(await runDurableObjectAlarm(graph)).toBe(true);
		const stats = (await t.stats()).body;
		expect(stats.nodes).toBeLessThanOrEqual(2);
		expect(stats.evictions.node_budget.count).toBeGreaterThanOrEqual(1);
	});
});

describe("managed mode's snapshots", () => {
	/**
	 * A registered host that is this test's double: global fetch answers its
	 * URL, and a snapshot request waits at `g` before it answers.
	 */
	async function heldHost(task: string, g: ReturnType<typeof gate>) {
		const host = "fake-host.races.test";
		const reg = await api("POST", "/v1/hosts", {
			key: keys.host,
			json: {
				url: `http://${host}`,
				capacity: 4,
				drivers: ["workspace"],
			},
		});
		expect(reg.status).toBe(201);
		const real = globalThis.fetch;
		vi.spyOn(globalThis, "fetch").mockImplementation(async (input, init) => {
			const req = new Request(input, init);
			const url = new URL(req.url);
			if (url.host !== host) return real(input, init);
			const path = url.pathname;
			if (req.method === "POST" && path === "/sandboxes")
				return Response.json({ id: "sb", source: "fresh", startMs: 1 });
			if (path.endsWith("/exec"))
				return Response.json({
					output: "ran",
					exitCode: 0,
					execMs: 5000,
					timedOut: false,
				});
			if (path.endsWith("/snapshot")) {
				const { state } = (await req.json()) as { state: string };
				g.arrive();
				await g.opened();
				return Response.json({
					driver: "workspace",
					key: `snapshots/races/${task}/${state}/managed`,
					bytes: 7,
					snapshotMs: 1,
				});
			}
			return Response.json({});
		});
	}

	async function openRollout(task: string) {
		const open = await api("POST", `/v1/tasks/${task}/rollouts`, {
			key: keys.trainer,
			json: { template: { driver: "workspace" } },
		});
		expect(open.status).toBe(201);
		return open.body.id as string;
	}

	const callA = (task: string, rollout: string) =>
		api("POST", `/v1/tasks/${task}/rollouts/${rollout}/calls`, {
			key: keys.trainer,
			json: { tool: "bash", args: { cmd: "a" }, mutates: true },
		});

	it("keeps the snapshot a record attached while managed mode took its own", async () => {
		const task = "managed-second";
		const g = gate();
		await heldHost(task, g);
		const rollout = await openRollout(task);
		const call = callA(task, rollout);
		await g.reached();

		// Meanwhile a library-mode rollout records the same call with its snapshot.
		const t = taskApi(keys.trainer, task, NO_EDGE);
		const [{ id: state }] = pathIds([bash("a")]);
		const ref = {
			driver: "workspace",
			key: `snapshots/races/${task}/${state}/library`,
			bytes: 3,
		};
		await env.BLOBS.put(ref.key, "lib");
		const rec = await t.record({
			from: ROOT_ID,
			calls: [{ ...run(bash("a"), "ran", 5000), snapshot: ref }],
		});
		expect(rec.body.results[0].status).toBe("exists");
		g.open();
		expect((await call).status).toBe(200);

		const node = (await t.graph()).body.nodes.find(
			(n: { id: string }) => n.id === state,
		);
		expect(node.snapshot).toMatchObject({ key: ref.key });
		expect((await t.stats()).body.snapshots).toBe(1);
		const miss = await t.lookup({ history: [bash("a")], call: bash("b") });
		expect(miss.body.snapshot).toMatchObject({ key: ref.key });
	});

	it("attaches nothing when the node was evicted while its snapshot was taken", async () => {
		const task = "managed-evicted";
		const g = gate();
		await heldHost(task, g);
		const rollout = await openRollout(task);
		const call = callA(task, rollout);
		await g.reached();

		// The rollout is closed (its state no longer pinned) and evicted.
		const closed = await api(
			"DELETE",
			`/v1/tasks/${task}/rollouts/${rollout}`,
			{ key: keys.trainer },
		);
		expect(closed.status).toBe(200);
		expect((await stub(task).enforce(budgets({ nodes: 1 }))).nodes).toBe(1);
		g.open();
		// The call ran, but its node is gone: said so, not a 500.
		expectError(await call, 503, "not_recorded");

		const stats = (await taskApi(keys.trainer, task, NO_EDGE).stats()).body;
		expect({ nodes: stats.nodes, snapshots: stats.snapshots }).toEqual({
			nodes: 1,
			snapshots: 0,
		});
	});
});
