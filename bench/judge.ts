/**
 * The lookup benchmark's verdicts: its runs, one per route, rate and round,
 * judged against the targets.
 *
 * Every rate is run in rounds, each round every route once, so that a hit
 * and the floor it is compared with ran within seconds of each other. A
 * route's ratio is the median over the rounds of its p50 over the floor's
 * p50 in the same round: on this shared machine the floor itself moves from
 * one minute to the next, and one slow minute should not decide a verdict.
 *
 * The issue judges hits "at every rate the floor sustains". The floor
 * sustains a rate when it answers at least 95% of it and is not queueing:
 * its p50 is at most {@link TARGET.queueing} times the floor's p50 at the
 * run's lowest rate. An open-loop rate beyond what the runtime can do shows
 * as a p50 that is no longer the time to answer a request but the time
 * spent waiting behind others (at 4,096/s on a 2-core machine, 50 ms where
 * 2,048/s had 2 ms), while the answered share can still read 95%.
 */
import { stallsOf, type LatencySummary } from "./loadgen.ts";

/** The targets, from the issue, and what "the floor sustains" means here. */
export const TARGET = {
	/** Hit p50 at most this many times the floor's p50 ... */
	hitOverFloor: 1.3,
	/** ... at every rate where the floor answers this share of its target ... */
	sustained: 0.95,
	/** ... and its p50 is at most this many times its p50 at the lowest rate. */
	queueing: 5,
	/** Miss + record pair p50, ms. */
	missRecordP50Ms: 3,
};

/** Other load above this many cores makes a run suspect. */
export const NOISY_CORES = 0.25;

/** The routes whose figures are the floors that hits are compared with. */
export const isFloor = (route: string) =>
	route === "floor" || route === "graph floor";

/** What the verdicts read of one run (bench/lookup.ts RouteRun). */
export interface JudgedRun {
	route: string;
	targetRate: number;
	achievedRate: number;
	latencyUs: Pick<LatencySummary, "p50" | "p95" | "p99" | "max">;
	errors: number;
	restarted: boolean;
	lateSends: number;
	timelineMaxMs: number[];
	otherCores: number | null;
	/** Where the ok hits were answered (the lookup route only). */
	sources?: Record<"edge" | "graph" | "unknown", number>;
	stackCpuMsPerRequest: Record<string, number>;
	/** Which round of its rate (1-based); runs without one are round 1. */
	round?: number;
}

/** One route at one rate, over its rounds. */
export interface Line {
	rate: number;
	route: string;
	rounds: number;
	/** Medians over the rounds (latencies in µs), but `max` and `errors`. */
	achieved: number;
	p50: number;
	p95: number;
	p99: number;
	/** The worst latency of any round. */
	max: number;
	/** All rounds' errors. */
	errors: number;
	/** The Worker's CPU ms per request, median over the rounds. */
	cpu: number | null;
	/** Hit p50 over the floor's p50: the median of the rounds' ratios. */
	ratio: number | null;
	verdict: "PASS" | "FAIL";
	note: string;
}

/** The middle value; of an even number, the mean of the two middle ones. */
export function median(xs: number[]): number {
	const s = [...xs].sort((a, b) => a - b);
	const m = s.length >> 1;
	return s.length === 0 ? NaN : s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}
const roundOf = (r: JudgedRun) => r.round ?? 1;
const fmt = (x: number) => x.toFixed(2);

/**
 * The median over rounds of `run`'s p50 over that of the `floor` run of the
 * same round; each ratio of a round, in round order. Null without a pair.
 */
function ratios(
	runs: JudgedRun[],
	floors: JudgedRun[],
): { median: number; each: number[] } | null {
	const each: number[] = [];
	for (const r of [...runs].sort((a, b) => roundOf(a) - roundOf(b))) {
		const f = floors.find((x) => roundOf(x) === roundOf(r));
		if (f && f.latencyUs.p50 > 0) each.push(r.latencyUs.p50 / f.latencyUs.p50);
	}
	return each.length > 0 ? { median: median(each), each } : null;
}

/** Why the floor does not sustain each rate: null where it does. */
function notSustained(runs: JudgedRun[]): Map<number, string | null> {
	const floors = runs.filter((r) => r.route === "floor");
	const rates = [...new Set(floors.map((r) => r.targetRate))].sort(
		(a, b) => a - b,
	);
	const p50At = (rate: number) =>
		median(
			floors.filter((r) => r.targetRate === rate).map((r) => r.latencyUs.p50),
		);
	const out = new Map<number, string | null>();
	if (rates.length === 0) return out;
	const lowest = rates[0];
	for (const rate of rates) {
		const at = floors.filter((r) => r.targetRate === rate);
		const share = median(at.map((r) => r.achievedRate)) / rate;
		const growth = p50At(rate) / p50At(lowest);
		let why: string | null = null;
		if (share < TARGET.sustained) {
			why = `answered ${Math.round(100 * share)}% of the rate`;
		} else if (growth > TARGET.queueing) {
			why = `queueing: p50 ${growth.toFixed(0)}x its ${lowest}/s p50`;
		}
		out.set(rate, why);
	}
	return out;
}

/** The lines of the table: one per route and rate, in the runs' order. */
export function judge(runs: JudgedRun[]): Line[] {
	const whyNot = notSustained(runs);
	const keys: { rate: number; route: string }[] = [];
	for (const r of runs) {
		if (!keys.some((k) => k.rate === r.targetRate && k.route === r.route))
			keys.push({ rate: r.targetRate, route: r.route });
	}
	return keys.map(({ rate, route }) => {
		const at = (name: string) =>
			runs.filter((r) => r.targetRate === rate && r.route === name);
		const mine = at(route);
		// Why the floor does not sustain this rate, or null where it does.
		const unsustained = whyNot.has(rate) ? whyNot.get(rate)! : "no floor run";
		const ratio = isFloor(route) ? null : ratios(mine, at("floor"));
		const graphRatio = isFloor(route) ? null : ratios(mine, at("graph floor"));

		const notes: string[] = [];
		const errors = mine.reduce((n, r) => n + r.errors, 0);
		const restarted = mine.some((r) => r.restarted);
		let pass = errors === 0 && !restarted;
		if (restarted) notes.push("INVALID: the Worker restarted mid-run");
		if (errors > 0) notes.push(`${errors} errors`);
		if (isFloor(route)) {
			if (route === "floor" && unsustained !== null)
				notes.push(`floor not sustained (${unsustained})`);
		} else if (unsustained !== null) {
			notes.push("ratio not judged: floor not sustained");
		} else if (ratio === null) {
			pass = false;
			notes.push("no floor run of the same round to compare with");
		} else if (ratio.median > TARGET.hitOverFloor) {
			pass = false;
			notes.push(`p50 over ${TARGET.hitOverFloor}x floor`);
		}
		if (ratio !== null && ratio.each.length > 1)
			notes.push(`rounds ${ratio.each.map(fmt).join(", ")}`);
		const late = mine.reduce((n, r) => n + r.lateSends, 0);
		if (late > 0) notes.push(`generator late ${late}x`);
		const stalls = mine.flatMap((r) => stallsOf(r.timelineMaxMs));
		if (stalls.length > 0) {
			const peak = Math.max(...stalls.map((s) => s.peakMs));
			notes.push(`${stalls.length} stalls, worst ${Math.round(peak)} ms`);
		}
		const other = Math.max(...mine.map((r) => r.otherCores ?? 0));
		if (other > NOISY_CORES) notes.push(`other load ${other} cores`);
		const edge = mine.reduce((n, r) => n + (r.sources?.edge ?? 0), 0);
		const graph = mine.reduce((n, r) => n + (r.sources?.graph ?? 0), 0);
		// Only the lookup route says where a hit came from.
		if (edge + graph > 0)
			notes.push(`${Math.round((100 * edge) / (edge + graph))}% edge`);
		if (graphRatio !== null)
			notes.push(`${fmt(graphRatio.median)}x graph floor`);

		const cpus = mine
			.map((r) => r.stackCpuMsPerRequest["workerd (worker)"])
			.filter((x): x is number => x !== undefined);
		return {
			rate,
			route,
			rounds: mine.length,
			achieved: median(mine.map((r) => r.achievedRate)),
			p50: median(mine.map((r) => r.latencyUs.p50)),
			p95: median(mine.map((r) => r.latencyUs.p95)),
			p99: median(mine.map((r) => r.latencyUs.p99)),
			max: Math.max(...mine.map((r) => r.latencyUs.max)),
			errors,
			cpu: cpus.length > 0 ? median(cpus) : null,
			ratio: ratio?.median ?? null,
			verdict: pass ? "PASS" : "FAIL",
			note: notes.join("; "),
		};
	});
}
