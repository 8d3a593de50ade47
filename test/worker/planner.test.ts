import { describe, expect, it } from "vitest";
import {
	blend,
	decideSnapshot,
	plan,
	type PathState,
} from "../../core/planner.ts";

const costs = { startMs: 500, restoreMs: 300, poolMs: 20 };
const state = (execMs: number, snapshot = false, warm = false): PathState => ({
	id: String(execMs),
	execMs,
	snapshot,
	warm,
});

describe("the miss planner", () => {
	it("starts fresh and replays everything when nothing else exists", () => {
		expect(
			plan({
				path: [state(100), state(200)],
				liveDepth: null,
				warmRoot: false,
				costs,
			}),
		).toEqual({
			kind: "fresh",
			from: 0,
			costMs: 800,
		});
	});

	it("uses a warm root sandbox when one is ready", () => {
		expect(
			plan({ path: [state(100)], liveDepth: null, warmRoot: true, costs }),
		).toMatchObject({
			kind: "fresh",
			costMs: 120,
		});
	});

	it("restores the deepest snapshot when replaying from it is cheapest", () => {
		const path = [state(1000), state(2000, true), state(50)];
		expect(plan({ path, liveDepth: null, warmRoot: false, costs })).toEqual({
			kind: "restore",
			from: 2,
			costMs: 350,
		});
	});

	it("prefers the rollout's own sandbox when the catch-up is short", () => {
		const path = [state(1000), state(2000, true), state(50)];
		expect(plan({ path, liveDepth: 2, warmRoot: false, costs })).toEqual({
			kind: "live",
			from: 2,
			costMs: 50,
		});
	});

	it("prefers a warm fork of a snapshot over restoring it", () => {
		const path = [state(1000, true, true), state(10)];
		expect(plan({ path, liveDepth: null, warmRoot: false, costs })).toEqual({
			kind: "warm",
			from: 1,
			costMs: 30,
		});
	});

	it("replays from the root when a restore costs more than the calls it skips", () => {
		const path = [state(10, true), state(10)];
		expect(plan({ path, liveDepth: null, warmRoot: false, costs }).kind).toBe(
			"restore",
		);
		expect(plan({ path, liveDepth: null, warmRoot: true, costs }).kind).toBe(
			"fresh",
		);
	});
});

describe("selective snapshots", () => {
	it("snapshots only when replay would cost more than snapshot plus restore", () => {
		expect(decideSnapshot(5000, 800, 700)).toEqual({
			replayMs: 5000,
			costMs: 1500,
			snapshot: true,
		});
		expect(decideSnapshot(1000, 800, 700).snapshot).toBe(false);
	});

	it("learns a cost from measurements, quickly at first", () => {
		expect(blend(1000, 0, 100)).toBe(100);
		// Past the first few samples it still moves a fifth of the way each time.
		const later = [5, 6, 7, 8, 9, 10].reduce((v, n) => blend(v, n, 100), 1000);
		expect(later).toBeGreaterThan(100);
		// Six samples at a weight of a fifth: 100 + 900 × 0.8^6 ≈ 336.
		expect(later).toBeCloseTo(100 + 900 * 0.8 ** 6, 6);
	});
});
