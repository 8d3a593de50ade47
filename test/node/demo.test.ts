/**
 * The demo as a user runs it (`npm run demo -- --local`): its own stack and
 * host, a small GRPO-like workload through managed mode, and figures that
 * agree with each other and with the workload that was sent.
 */
import { execFile } from "node:child_process";
import path from "node:path";
import { promisify } from "node:util";
import { describe, expect, it } from "vitest";
import { REPO_ROOT } from "../../bin/local-stack.ts";
import { callCount, terminalWorkload } from "../../bench/workloads.ts";

const TSX = path.join(REPO_ROOT, "node_modules", ".bin", "tsx");
const DEMO = path.join(REPO_ROOT, "bin", "demo.ts");
const run = promisify(execFile);

/** `label   N (epoch 1: A, epoch 2: B)` → [N, A, B] (numbers as printed). */
function line(out: string, label: string): number[] {
	const m = new RegExp(`^${label}\\s+(.+)$`, "m").exec(out);
	if (!m) throw new Error(`no "${label}" line in:\n${out}`);
	return [...m[1].matchAll(/(\d+(?:\.\d+)?)/g)].map((x) => Number(x[1]));
}

describe("npm run demo -- --local", () => {
	it("runs a GRPO-like workload and prints figures consistent with it: epoch 2 hits, the speedup is without / with", async () => {
		const options = { tasks: 1, group: 4, epochs: 2 };
		const { stdout, stderr } = await run(
			TSX,
			[
				DEMO,
				"--local",
				"--driver",
				"workspace",
				"--tasks",
				String(options.tasks),
				"--group",
				String(options.group),
				"--epochs",
				String(options.epochs),
			],
			{ cwd: REPO_ROOT, timeout: 240_000, maxBuffer: 8 << 20 },
		);

		// What was sent: the same deterministic workload the demo built.
		const w = terminalWorkload({ ...options, driver: "workspace" });
		const perEpoch = [1, 2].map((e) =>
			w.groups
				.filter((g) => g.epoch === e)
				.reduce((n, g) => n + g.rollouts.reduce((k, r) => k + r.length, 0), 0),
		);
		expect(line(stdout, "calls")).toEqual([
			callCount(w),
			1,
			perEpoch[0],
			2,
			perEpoch[1],
		]);
		// Progress went to stderr, up to the last call.
		expect(stderr).toContain(`${callCount(w)}/${callCount(w)} calls`);

		const [hits, , hits1, , hits2] = line(stdout, "hits");
		expect(hits).toBe(hits1 + hits2);
		// Epoch 2 repeats paths epoch 1 recorded: it hits, and more often.
		expect(hits2).toBeGreaterThan(0);
		expect(hits2 / perEpoch[1]).toBeGreaterThan(hits1 / perEpoch[0]);

		// Percentages are printed to 0.1.
		const [rate, , rate1, , rate2] = line(stdout, "hit rate");
		const near = (printed: number, exact: number) =>
			expect(Math.abs(printed - exact)).toBeLessThanOrEqual(0.051);
		near(rate, (100 * hits) / callCount(w));
		near(rate1, (100 * hits1) / perEpoch[0]);
		near(rate2, (100 * hits2) / perEpoch[1]);

		// A group's identical first calls run once: the others are coalesced hits.
		const [coalesced] = line(stdout, "coalesced hits");
		expect(coalesced).toBeGreaterThan(0);
		expect(coalesced).toBeLessThanOrEqual(hits);

		const [without] = line(stdout, "tool time without");
		const [withCache] = line(stdout, "tool time with");
		const [speedup] = line(stdout, "speedup");
		expect(without).toBeGreaterThan(0);
		expect(withCache).toBeGreaterThan(0);
		// Both times are printed to 0.1 s and the ratio to 0.01: they agree
		// within that.
		expect(speedup).toBeGreaterThanOrEqual(
			(without - 0.05) / (withCache + 0.05) - 0.005,
		);
		expect(speedup).toBeLessThanOrEqual(
			(without + 0.05) / (withCache - 0.05) + 0.005,
		);

		const [snapshots, snapshotKiB] = line(stdout, "snapshots");
		expect(snapshots).toBeGreaterThanOrEqual(0);
		if (snapshots === 0) expect(snapshotKiB).toBe(0);
		else expect(snapshotKiB).toBeGreaterThan(0);
	}, 300_000);
});
