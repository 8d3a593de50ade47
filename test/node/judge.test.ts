/**
 * The lookup benchmark's verdicts (bench/judge.ts): ratios as medians over
 * rounds, and which rates the floor sustains.
 */
import { describe, expect, it } from "vitest";
import { judge, type JudgedRun } from "../../bench/judge.ts";

/** A clean run: answered in full, no errors, no stalls. p50 in ms. */
function run(
	route: string,
	rate: number,
	p50Ms: number,
	more: Partial<JudgedRun> = {},
): JudgedRun {
	return {
		route,
		targetRate: rate,
		achievedRate: rate,
		latencyUs: {
			p50: p50Ms * 1000,
			p95: p50Ms * 2000,
			p99: p50Ms * 4000,
			max: p50Ms * 8000,
		},
		errors: 0,
		restarted: false,
		lateSends: 0,
		timelineMaxMs: [p50Ms, p50Ms],
		otherCores: 0,
		stackCpuMsPerRequest: { "workerd (worker)": 0.4 },
		...more,
	};
}

const line = (lines: ReturnType<typeof judge>, rate: number, route: string) =>
	lines.find((l) => l.rate === rate && l.route === route)!;

describe("judge", () => {
	it("passes a hit within 1.3x of the floor and fails one over it", () => {
		const lines = judge([
			run("floor", 256, 1.0),
			run("hit (history)", 256, 1.29),
			run("hit (cursor)", 256, 1.31),
		]);
		expect(line(lines, 256, "hit (history)")).toMatchObject({
			ratio: 1.29,
			verdict: "PASS",
		});
		const cursor = line(lines, 256, "hit (cursor)");
		expect(cursor.verdict).toBe("FAIL");
		expect(cursor.note).toContain("p50 over 1.3x floor");
	});

	it("takes each round's ratio against the floor of the same round, and their median", () => {
		// The machine's speed moves between rounds, the floor's and the hit's
		// with it. Pooled, the p50s' medians (3.0 over 2.0) read 1.5x, a
		// fail; round by round the hit is 1.1x, 1.1x and 1.5x: a pass.
		const floors = [1, 4, 2];
		const over = [1.1, 1.1, 1.5];
		const rounds = [1, 2, 3].map((round) => [
			run("floor", 512, floors[round - 1], { round }),
			run("hit (id)", 512, floors[round - 1] * over[round - 1], { round }),
		]);
		const l = line(judge(rounds.flat()), 512, "hit (id)");
		expect(l.rounds).toBe(3);
		expect(l.ratio).toBeCloseTo(1.1, 6);
		expect(l.verdict).toBe("PASS");
		expect(l.note).toContain("rounds 1.10, 1.10, 1.50");
		// The line's own figures are medians over its rounds.
		expect(l.p50).toBeCloseTo(3000, 6);
	});

	it("takes the mean of the two middle ratios of an even number of rounds", () => {
		const lines = judge(
			[1, 2].flatMap((round) => [
				run("floor", 256, 1, { round }),
				run("hit (id)", 256, round === 1 ? 1.2 : 1.4, { round }),
			]),
		);
		// Not the lower of the two (1.2, a pass): their mean, 1.3, a pass at
		// the limit; a fourth round at 1.5 would make it 1.35.
		expect(line(lines, 256, "hit (id)").ratio).toBeCloseTo(1.3, 6);
	});

	it("adds up every round's errors and fails the line on any", () => {
		const errors = [2, 0, 3];
		const lines = judge(
			[1, 2, 3].flatMap((round) => [
				run("floor", 1024, 1, { round }),
				run("hit (id)", 1024, 1, { round, errors: errors[round - 1] }),
			]),
		);
		expect(line(lines, 1024, "hit (id)")).toMatchObject({
			errors: 5,
			verdict: "FAIL",
		});
		expect(line(lines, 1024, "floor").verdict).toBe("PASS");
	});

	it("fails a hit with no floor run of its round to compare with", () => {
		const lines = judge([
			run("floor", 256, 1, { round: 2 }),
			run("hit (id)", 256, 1, { round: 1 }),
		]);
		const l = line(lines, 256, "hit (id)");
		expect(l.ratio).toBeNull();
		expect(l.verdict).toBe("FAIL");
		expect(l.note).toContain("no floor run of the same round");
	});

	it("does not judge hits where the floor answers under 95% of the rate", () => {
		const lines = judge([
			run("floor", 256, 1),
			run("floor", 4096, 1.2, { achievedRate: 3800 }),
			run("hit (id)", 4096, 9),
		]);
		expect(line(lines, 4096, "floor").note).toContain(
			"floor not sustained (answered 93% of the rate)",
		);
		const hit = line(lines, 4096, "hit (id)");
		expect(hit.verdict).toBe("PASS");
		expect(hit.note).toContain("ratio not judged: floor not sustained");
	});

	it("judges the floor's share and p50 by their medians over the rounds", () => {
		const rounds = [1, 2, 3];
		const lines = judge([
			// The lowest rate's p50 is 1 ms, but for one slow first round.
			...rounds.map((round) =>
				run("floor", 256, [30, 1, 1][round - 1], { round }),
			),
			// 6 ms is 6x that: queueing, though 0.2x the slow round.
			...rounds.map((round) => run("floor", 1024, 6, { round })),
			...rounds.map((round) => run("hit (id)", 1024, 6, { round })),
			// One round of three answered 90%: the median share is 100%.
			...rounds.map((round) =>
				run("floor", 2048, 1.5, {
					round,
					achievedRate: round === 2 ? 1843 : 2048,
				}),
			),
			...rounds.map((round) => run("hit (id)", 2048, 3, { round })),
		]);
		expect(line(lines, 1024, "floor").note).toContain(
			"floor not sustained (queueing: p50 6x its 256/s p50)",
		);
		expect(line(lines, 1024, "hit (id)").note).toContain("ratio not judged");
		expect(line(lines, 2048, "floor").note).not.toContain("not sustained");
		expect(line(lines, 2048, "hit (id)")).toMatchObject({
			ratio: 2,
			verdict: "FAIL",
		});
	});

	it("does not judge hits where the floor queues, though it answered 95%", () => {
		const lines = judge([
			run("floor", 256, 1.4),
			run("floor", 2048, 1.9),
			run("hit (id)", 2048, 2.6),
			run("floor", 4096, 50, { achievedRate: 3904 }),
			run("hit (id)", 4096, 3000),
		]);
		// 1.9 ms is under 5x 1.4: sustained, so 2,048/s is judged (and fails).
		expect(line(lines, 2048, "hit (id)").verdict).toBe("FAIL");
		expect(line(lines, 4096, "floor").note).toContain(
			"floor not sustained (queueing: p50 36x its 256/s p50)",
		);
		expect(line(lines, 4096, "hit (id)").note).toContain(
			"ratio not judged: floor not sustained",
		);
	});

	it("fails a line whose Worker restarted, and says why", () => {
		const lines = judge([
			run("floor", 256, 1),
			run("hit (id)", 256, 1, { restarted: true }),
		]);
		const l = line(lines, 256, "hit (id)");
		expect(l.verdict).toBe("FAIL");
		expect(l.note).toContain("INVALID");
	});

	it("notes stalls, lateness, where hits came from and the graph floor", () => {
		const lines = judge([
			run("floor", 256, 1),
			run("graph floor", 256, 1.5),
			run("hit (history)", 256, 1.2, {
				timelineMaxMs: [2, 150, 2, 2, 2, 2, 2, 2, 2, 2, 2, 320],
				lateSends: 4,
				sources: { edge: 3, graph: 1, unknown: 0 },
				otherCores: 0.5,
			}),
		]);
		const note = line(lines, 256, "hit (history)").note;
		expect(note).toContain("generator late 4x");
		expect(note).toContain("2 stalls, worst 320 ms");
		expect(note).toContain("75% edge");
		expect(note).toContain("0.80x graph floor");
		expect(note).toContain("other load 0.5 cores");
	});

	it("keeps the Worker's CPU per request, median over rounds", () => {
		const lines = judge(
			[0.3, 0.4, 0.9].flatMap((cpu, i) => [
				run("floor", 256, 1, { round: i + 1 }),
				run("hit (id)", 256, 1, {
					round: i + 1,
					stackCpuMsPerRequest: { "workerd (worker)": cpu },
				}),
			]),
		);
		expect(line(lines, 256, "hit (id)").cpu).toBeCloseTo(0.4, 6);
	});
});
