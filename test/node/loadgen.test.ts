/**
 * The load generator's stall summary: what the lookup bench reports of each
 * run's timeline (the worst latency per 100 ms of intended send time).
 */
import { describe, expect, it } from "vitest";
import { stallsOf } from "../../bench/loadgen.ts";

describe("stallsOf", () => {
	it("finds none in a timeline under the threshold", () => {
		expect(stallsOf([1.2, 3.4, 99.9, 2])).toEqual([]);
	});

	it("joins consecutive windows at or over the threshold into one stall", () => {
		// A 500 ms pause: requests sent in the windows it spans wait out the rest of it.
		expect(stallsOf([2, 510, 420, 310, 205, 100, 3])).toEqual([
			{ atS: 0.1, windows: 5, peakMs: 510 },
		]);
	});

	it("keeps stalls apart that a quiet window separates, in order", () => {
		expect(
			stallsOf([150, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 300, 120], 100),
		).toEqual([
			{ atS: 0, windows: 1, peakMs: 150 },
			{ atS: 1.1, windows: 2, peakMs: 300 },
		]);
	});

	it("takes another threshold", () => {
		expect(stallsOf([30, 60, 30], 50)).toEqual([
			{ atS: 0.1, windows: 1, peakMs: 60 },
		]);
	});
});
