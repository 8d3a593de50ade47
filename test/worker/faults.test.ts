/**
 * Faults injected into a running task graph, each with the invariant it
 * keeps (issue 4, faults 1, 3 and 6; the others are in eviction.test.ts,
 * leases.test.ts and the end-to-end host tests).
 */
import { env } from "cloudflare:workers";
import { abortAllDurableObjects } from "cloudflare:test";
import { afterEach, beforeAll, describe, expect, it, vi } from "vitest";
import {
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
	keys = await project("faults");
});
afterEach(() => {
	vi.restoreAllMocks();
});

describe("faults", () => {
	it("R2 refusing a write gives a retryable 503 and records nothing (fault 3)", async () => {
		const t = taskApi(keys.trainer, "r2-down");
		// The real R2 cannot be made to fail; this double refuses every write.
		const put = vi
			.spyOn(env.BLOBS, "put")
			.mockRejectedValue(new Error("R2 is down"));
		const big = "b".repeat(4096);
		const rec = await t.record({
			from: ROOT_ID,
			calls: [run(bash("small"), "s"), run(bash("big"), big)],
		});
		expectError(rec, 503, "storage_unavailable");
		expect(rec.headers.get("retry-after")).toBe("1");
		const up = await api(
			"PUT",
			`/v1/tasks/r2-down/snapshots/${"a".repeat(64)}?driver=workspace`,
			{
				key: keys.host,
				body: "snapshot bytes",
			},
		);
		expectError(up, 503, "storage_unavailable");
		expect(put).toHaveBeenCalled();
		expectError(await t.stats(), 404, "task_not_found");

		// Once R2 is back, the same record goes through whole.
		put.mockRestore();
		const again = await t.record({
			from: ROOT_ID,
			calls: [run(bash("small"), "s"), run(bash("big"), big)],
		});
		expect(again.body.results.map((r: { status: string }) => r.status)).toEqual(
			["recorded", "recorded"],
		);
		expect(
			(await t.lookup({ history: [bash("small")], call: bash("big") })).body
				.output,
		).toBe(big);
	});

	it("keeps one node and one output under duplicate and concurrent records (fault 6)", async () => {
		const t = taskApi(keys.trainer, "concurrent");
		const outputs = Array.from({ length: 12 }, (_, i) => `run ${i % 3}`);
		const replies = await Promise.all(
			outputs.map((o) =>
				t.record({
					from: ROOT_ID,
					calls: [run(bash("setup"), "ok"), run(bash("flaky"), o)],
				}),
			),
		);
		expect(replies.every((r) => r.status === 200)).toBe(true);
		const second = replies.map((r) => r.body.results[1].status);
		expect(second.filter((s) => s === "recorded")).toHaveLength(1);
		const winner = outputs[second.indexOf("recorded")];
		// Every other record agreed with the winner or was a conflict with it.
		for (const [i, s] of second.entries()) {
			if (s !== "recorded")
				expect(s).toBe(outputs[i] === winner ? "exists" : "conflict");
		}
		const stats = (await t.stats()).body;
		expect(stats.nodes).toBe(3);
		expect(
			(await t.lookup({ history: [bash("setup")], call: bash("flaky") })).body
				.output,
		).toBe(winner);
	});

	it("keeps every acknowledged record when the task graph restarts mid-traffic (fault 1)", async () => {
		const t = taskApi(keys.trainer, "restarts");
		const send = (i: number) =>
			t.record({
				from: ROOT_ID,
				calls: [
					run(bash(`step ${i}`), `out ${i}`),
					run(bash(`next ${i}`), `n ${i}`),
				],
			});
		const first = Array.from({ length: 20 }, (_, i) => send(i));
		// Restart while those are in flight; some may fail, none may half-land.
		await abortAllDurableObjects().catch(() => undefined);
		const replies = await Promise.all(first.map((p) => p.catch(() => null)));
		const acked = replies.flatMap((r, i) => (r?.status === 200 ? [i] : []));
		for (const i of acked) {
			const hit = await t.lookup({
				history: [bash(`step ${i}`)],
				call: bash(`next ${i}`),
			});
			expect(hit.body).toMatchObject({ status: "hit", output: `n ${i}` });
		}
		// Whatever did land, landed whole: each run's two nodes are both there or both not.
		const graph = (await t.graph("?limit=1000")).body.nodes;
		const cmds = new Set(
			graph.map((n: { args: { cmd?: string } | null }) => n.args?.cmd),
		);
		for (let i = 0; i < 20; i++)
			expect(cmds.has(`step ${i}`)).toBe(cmds.has(`next ${i}`));
		// Records sent again are idempotent: no duplicates.
		await Promise.all(Array.from({ length: 20 }, (_, i) => send(i)));
		expect((await t.stats()).body.nodes).toBe(41);
	});
});
