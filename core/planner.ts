/**
 * How to get a sandbox into a rollout's state on a miss, at least cost. The
 * candidates (TVCache §4 and its proactive forking, extended):
 *
 * - live:    the rollout's own sandbox, behind by some calls: replay them;
 * - warm:    a host holds a ready fork of a snapshot on the path: take it, replay below;
 * - restore: the deepest snapshot (or any snapshot) on the path: restore, replay below;
 * - fresh:   a new sandbox at the root (from a warm root pool if any): replay everything.
 *
 * Costs are recorded exec times of the calls to replay plus the measured
 * start / restore cost of the driver.
 */

/** One state on the path from the root (exclusive) to the target (inclusive). */
export interface PathState {
	id: string;
	execMs: number;
	snapshot: boolean;
	/** A host holds a warm fork of this state's snapshot. */
	warm: boolean;
}

export interface Costs {
	/** Starting a root sandbox. */
	startMs: number;
	/** Restoring a snapshot into a new sandbox. */
	restoreMs: number;
	/** Taking a ready sandbox from a warm pool. */
	poolMs: number;
}

export interface PlanInput {
	path: PathState[];
	/** Depth of the rollout's live sandbox on the path (0: at the root), if it has one. */
	liveDepth: number | null;
	/** Whether a warm root sandbox is ready for the template. */
	warmRoot: boolean;
	costs: Costs;
}

export interface Plan {
	kind: "live" | "warm" | "restore" | "fresh";
	/** Depth the sandbox starts at; `path.slice(from)` is replayed. */
	from: number;
	costMs: number;
}

/** The cheapest plan; ties go to the plan that touches the fewest sandboxes. */
export function plan(input: PlanInput): Plan {
	const { path, costs } = input;
	// suffix[d] = exec time of replaying path[d..].
	const suffix = new Array<number>(path.length + 1).fill(0);
	for (let d = path.length - 1; d >= 0; d--)
		suffix[d] = suffix[d + 1] + path[d].execMs;

	const options: Plan[] = [];
	if (input.liveDepth !== null) {
		options.push({
			kind: "live",
			from: input.liveDepth,
			costMs: suffix[input.liveDepth],
		});
	}
	for (let d = path.length; d >= 1; d--) {
		const s = path[d - 1];
		if (!s.snapshot) continue;
		options.push(
			s.warm
				? { kind: "warm", from: d, costMs: costs.poolMs + suffix[d] }
				: { kind: "restore", from: d, costMs: costs.restoreMs + suffix[d] },
		);
	}
	options.push({
		kind: "fresh",
		from: 0,
		costMs: (input.warmRoot ? costs.poolMs : costs.startMs) + suffix[0],
	});
	const order = { live: 0, warm: 1, restore: 2, fresh: 3 };
	options.sort((a, b) => a.costMs - b.costMs || order[a.kind] - order[b.kind]);
	return options[0];
}

export interface SnapshotDecision {
	/** Exec time to rebuild this state from the nearest snapshot above it (or a fresh start). */
	replayMs: number;
	/** Measured snapshot + restore cost for the driver. */
	costMs: number;
	snapshot: boolean;
}

/**
 * Selective snapshots: take one after a state-changing call when rebuilding
 * the state by replay would cost more than storing and restoring it.
 */
export function decideSnapshot(
	replayMs: number,
	snapshotMs: number,
	restoreMs: number,
): SnapshotDecision {
	const costMs = snapshotMs + restoreMs;
	return { replayMs, costMs, snapshot: replayMs > costMs };
}

/**
 * A running estimate of a cost (exponentially weighted), seeded with a prior
 * so the first decisions are sensible before anything was measured.
 */
export function blend(
	previous: number,
	samples: number,
	measured: number,
): number {
	const weight = Math.max(0.2, 1 / (samples + 1));
	return previous + weight * (measured - previous);
}
