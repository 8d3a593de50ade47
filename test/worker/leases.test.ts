import { env } from "cloudflare:workers";
import { runDurableObjectAlarm, runInDurableObject } from "cloudflare:test";
import { beforeAll, describe, expect, it } from "vitest";
import { advanceClock, now } from "../../core/clock.ts";
import {
	NO_EDGE,
	ROOT_ID,
	bash,
	expectError,
	project,
	run,
	taskApi,
	snapshotBlob,
	stateAfter,
} from "./helpers.ts";

let keys: Awaited<ReturnType<typeof project>>;
beforeAll(async () => {
	keys = await project("leases");
});

const stub = (task: string) =>
	env.TASK_GRAPH.get(env.TASK_GRAPH.idFromName(`leases/${task}`));

async function snapshotted(task: string) {
	const t = taskApi(keys.trainer, task);
	// A record's ref must name a blob of this task and state that R2 holds.
	const snap = await snapshotBlob(
		"leases",
		task,
		stateAfter(bash("setup")),
		10,
	);
	const rec = await t.record({
		from: ROOT_ID,
		calls: [{ ...run(bash("setup"), "ok"), snapshot: snap }],
	});
	return { t, state: rec.body.state as string };
}

describe("leases", () => {
	it("acquires, renews and releases a lease", async () => {
		const { t, state } = await snapshotted("cycle");
		const l = await t.lease({ state, ttlMs: 5000 });
		expect(l.status).toBe(201);
		expect(l.body).toMatchObject({ state });
		expect(l.body.expiresAt).toBeGreaterThanOrEqual(now() + 4000);

		const renewed = await t.renew(l.body.id, { ttlMs: 60_000 });
		expect(renewed.status).toBe(200);
		expect(renewed.body.expiresAt).toBeGreaterThan(l.body.expiresAt);
		expect((await t.stats()).body.leases).toBe(1);

		expect((await t.release(l.body.id)).body).toEqual({
			id: l.body.id,
			released: true,
		});
		expect((await t.stats()).body.leases).toBe(0);
		expectError(await t.release(l.body.id), 404, "lease_not_found");
	});

	it("expires a lease through the object's alarm; renewing it then gets 409", async () => {
		const { t, state } = await snapshotted("expiry");
		const l = await t.lease({ state, ttlMs: 1000 });
		advanceClock(1001);
		expect(await runDurableObjectAlarm(stub("expiry"))).toBe(true);
		expect((await t.stats()).body.leases).toBe(0);
		expectError(await t.renew(l.body.id), 409, "lease_expired");
		expectError(await t.release(l.body.id), 409, "lease_expired");
	});

	it("treats a lease past its time as expired even before the alarm runs", async () => {
		const { t, state } = await snapshotted("late");
		const l = await t.lease({ state, ttlMs: 50 });
		advanceClock(51);
		expectError(await t.renew(l.body.id), 409, "lease_expired");
	});

	it("gives the same end state when the alarm runs twice", async () => {
		const { t, state } = await snapshotted("twice");
		await t.lease({ state, ttlMs: 100 });
		const keep = await t.lease({ state, ttlMs: 10 * 60_000 });
		advanceClock(101);
		await runDurableObjectAlarm(stub("twice"));
		const once = (await t.stats()).body;
		// A retried alarm: the same handler again, with nothing newly due.
		await runInDurableObject(stub("twice"), (graph) => graph.alarm());
		expect((await t.stats()).body).toEqual(once);
		expect(once.leases).toBe(1);
		expect((await t.renew(keep.body.id)).status).toBe(200);
	});

	it("caps a lease's time at the configured maximum", async () => {
		const { t, state } = await snapshotted("cap");
		const l = await t.lease({ state, ttlMs: 10 ** 9 });
		expect(l.body.expiresAt).toBeLessThanOrEqual(
			now() + Number(env.LEASE_MAX_TTL_MS),
		);
	});

	it("refuses a lease on a state the task does not hold, with 404", async () => {
		const { t } = await snapshotted("unknown");
		expectError(
			await t.lease({ state: "a".repeat(64) }),
			404,
			"state_not_found",
		);
		expect((await t.stats()).body.leases).toBe(0);
	});
});

describe("the task index", () => {
	it("lists a task after its graph writes the index from its alarm", async () => {
		const t = taskApi(keys.trainer, "indexed");
		// Without the edge cache, so the lookup below is counted by the graph.
		await taskApi(keys.trainer, "indexed", NO_EDGE).record({
			from: ROOT_ID,
			calls: [run(bash("a"), "1"), run(bash("b"), "2")],
		});
		await t.lookup({ history: [], call: bash("a") });
		advanceClock(3000);
		await runDurableObjectAlarm(stub("indexed"));
		const { api } = await import("./helpers.ts");
		const list = await api("GET", "/v1/tasks?limit=100", { key: keys.trainer });
		expect(list.status).toBe(200);
		const row = list.body.tasks.find(
			(x: { task: string }) => x.task === "indexed",
		);
		expect(row).toMatchObject({
			task: "indexed",
			nodes: 3,
			lookups: 1,
			hits: 1,
		});
	});
});
