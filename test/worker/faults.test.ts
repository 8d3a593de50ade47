/**
 * Faults injected into a running task graph, each with the invariant it
 * keeps (issue 4, faults 1, 3 and 6; the others are in eviction.test.ts,
 * leases.test.ts and the end-to-end host tests).
 */
import { env } from "cloudflare:workers";
import { abortAllDurableObjects } from "cloudflare:test";
import { afterEach, beforeAll, describe, expect, it, vi } from "vitest";
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
		// The edge cache off: a lookup after the restart must ask the graph,
		// not the Worker's memory of what it recorded.
		const t = taskApi(keys.trainer, "restarts", NO_EDGE);
		// Runs 10-19 carry an output for R2, unique to each run.
		const output = (i: number) => (i < 10 ? `n ${i}` : `n ${i} `.repeat(300));
		const send = (i: number) =>
			t.record({
				from: ROOT_ID,
				calls: [
					run(bash(`step ${i}`), `out ${i}`),
					run(bash(`next ${i}`), output(i)),
				],
			});
		const before = await Promise.all(
			Array.from({ length: 10 }, (_, i) => send(i)),
		);
		expect(before.every((r) => r.status === 200)).toBe(true);

		// The others are held in the graph, their blobs written and their
		// rows not, when it restarts. The double polls a flag: a promise
		// shared with the graph would cross request contexts.
		const held = { at: 0, open: false };
		const put = env.BLOBS.put.bind(env.BLOBS);
		vi.spyOn(env.BLOBS, "put").mockImplementation(async (k, v, o) => {
			const r = await put(k, v, o);
			held.at++;
			while (!held.open) await new Promise((res) => setTimeout(res, 1));
			return r;
		});
		const during = Array.from({ length: 10 }, (_, i) =>
			send(10 + i).catch(() => null),
		);
		while (held.at < 10) await new Promise((res) => setTimeout(res, 1));
		await abortAllDurableObjects();
		held.open = true;
		const replies = [...before, ...(await Promise.all(during))];
		vi.restoreAllMocks();

		const acked = replies.flatMap((r, i) => (r?.status === 200 ? [i] : []));
		// The restart fell between acknowledged and cut-off requests.
		expect(acked).toEqual(Array.from({ length: 10 }, (_, i) => i));
		// Cut off: a 5xx (503 where the runtime marks the reset retryable;
		// the test runtime's abort is not marked, so 500).
		for (const r of replies.slice(10))
			expect(r?.status ?? 500).toBeGreaterThanOrEqual(500);
		for (const i of acked) {
			const hit = await t.lookup({
				history: [bash(`step ${i}`)],
				call: bash(`next ${i}`),
			});
			expect(hit.body).toMatchObject({ status: "hit", output: output(i) });
		}
		// Whatever did land, landed whole: each run's two nodes are both there or both not.
		const graph = (await t.graph("?limit=1000")).body.nodes;
		const cmds = new Set(
			graph.map((n: { args: { cmd?: string } | null }) => n.args?.cmd),
		);
		for (let i = 0; i < 20; i++)
			expect(cmds.has(`step ${i}`)).toBe(cmds.has(`next ${i}`));
		// Records sent again are idempotent: no duplicates, and the cut-off
		// ones land now.
		const again = await Promise.all(
			Array.from({ length: 20 }, (_, i) => send(i)),
		);
		expect(again.every((r) => r.status === 200)).toBe(true);
		expect((await t.stats()).body.nodes).toBe(41);
		for (let i = 10; i < 20; i++) {
			const hit = await t.lookup({
				history: [bash(`step ${i}`)],
				call: bash(`next ${i}`),
			});
			expect(hit.body).toMatchObject({ status: "hit", output: output(i) });
		}
	});
});
