/**
 * Budgets and eviction by expected value: which snapshots and which subtrees
 * a task graph gives up when it is over a budget. Pure functions over a
 * snapshot of the graph, so tests call them without a Durable Object.
 *
 * - A snapshot's value is the replay time it saves (exec time from it up to
 *   the nearest snapshot above it), weighted by how much it was used recently
 *   (hits and restores), by how many branches grow from it (a shallow branch
 *   point serves many rollouts), and against its depth; divided by its size.
 * - A subtree's value is the exec time its hits saved, weighted by recency;
 *   divided by the bytes it holds.
 * - Leased snapshots and the paths of open rollouts are pinned: never evicted.
 */

export interface Budgets {
	/** Per task. */
	snapshots: number;
	snapshotBytes: number;
	nodes: number;
	outputBytes: number;
	/** Per project. */
	tasks: number;
	projectBytes: number;
}

export interface EvictionNode {
	id: string;
	parent: string | null;
	depth: number;
	kind: "root" | "state" | "result";
	execMs: number;
	hits: number;
	restores: number;
	/** Last hit or restore (ms since the epoch), else when it was created. */
	lastUsedAt: number;
	outputBytes: number;
	/** Null when the node has no snapshot. */
	snapshotBytes: number | null;
}

/** What a row costs beyond its output and snapshot: ids, args, counters. */
const ROW_BYTES = 256;
/** Uses an hour old count half as much as uses now. */
const HALF_LIFE_MS = 60 * 60 * 1000;

function recency(lastUsedAt: number, now: number): number {
	return 1 / (1 + Math.max(0, now - lastUsedAt) / HALF_LIFE_MS);
}

export interface Graph {
	nodes: Map<string, EvictionNode>;
	children: Map<string, string[]>;
}

export function graphOf(nodes: Iterable<EvictionNode>): Graph {
	const map = new Map<string, EvictionNode>();
	const children = new Map<string, string[]>();
	for (const n of nodes) {
		map.set(n.id, n);
		if (n.parent !== null) {
			const list = children.get(n.parent);
			if (list) list.push(n.id);
			else children.set(n.parent, [n.id]);
		}
	}
	return { nodes: map, children };
}

/** Exec time to rebuild a state from the nearest snapshot above it (or the root). */
function replayMs(g: Graph, id: string): number {
	let total = 0;
	let n = g.nodes.get(id);
	while (n && n.kind !== "root") {
		total += n.execMs;
		const parent: EvictionNode | undefined =
			n.parent === null ? undefined : g.nodes.get(n.parent);
		if (!parent || parent.snapshotBytes !== null) break;
		n = parent;
	}
	return total;
}

/** Each snapshot's value per byte; the lowest goes first. */
export function snapshotScores(g: Graph, now: number): Map<string, number> {
	const scores = new Map<string, number>();
	for (const n of g.nodes.values()) {
		if (n.snapshotBytes === null) continue;
		const branches = (g.children.get(n.id) ?? []).filter(
			(c) => g.nodes.get(c)?.kind === "state",
		).length;
		const uses = (n.hits + n.restores) * recency(n.lastUsedAt, now);
		const value =
			(replayMs(g, n.id) * (1 + uses) * (1 + branches)) / (1 + n.depth);
		scores.set(n.id, value / (n.snapshotBytes + ROW_BYTES));
	}
	return scores;
}

export interface Usage {
	snapshots: number;
	snapshotBytes: number;
	nodes: number;
	outputBytes: number;
}

export function usageOf(g: Graph): Usage {
	const u = { snapshots: 0, snapshotBytes: 0, nodes: 0, outputBytes: 0 };
	for (const n of g.nodes.values()) {
		u.nodes++;
		u.outputBytes += n.outputBytes;
		if (n.snapshotBytes !== null) {
			u.snapshots++;
			u.snapshotBytes += n.snapshotBytes;
		}
	}
	return u;
}

/** The snapshots to drop, least valuable first, until within the snapshot budgets. */
export function snapshotsToEvict(
	g: Graph,
	budgets: Pick<Budgets, "snapshots" | "snapshotBytes">,
	pinned: ReadonlySet<string>,
	now: number,
): string[] {
	const u = usageOf(g);
	if (
		u.snapshots <= budgets.snapshots &&
		u.snapshotBytes <= budgets.snapshotBytes
	)
		return [];
	const scores = snapshotScores(g, now);
	const order = [...scores.entries()]
		.filter(([id]) => !pinned.has(id))
		.sort((a, b) => a[1] - b[1] || (a[0] < b[0] ? -1 : 1));
	const out: string[] = [];
	let { snapshots, snapshotBytes } = u;
	for (const [id] of order) {
		if (
			snapshots <= budgets.snapshots &&
			snapshotBytes <= budgets.snapshotBytes
		)
			break;
		out.push(id);
		snapshots--;
		snapshotBytes -= g.nodes.get(id)!.snapshotBytes!;
	}
	return out;
}

interface Subtree {
	count: number;
	bytes: number;
	outputBytes: number;
	value: number;
	pinned: boolean;
}

/** Totals of every subtree, from the leaves up. */
export function subtrees(
	g: Graph,
	pinned: ReadonlySet<string>,
	now: number,
): Map<string, Subtree> {
	const out = new Map<string, Subtree>();
	// Deepest first: a state's children are one level deeper, and a result
	// shares its parent's depth, so order by depth, results before states.
	const order = [...g.nodes.values()].sort(
		(a, b) =>
			b.depth - a.depth ||
			(a.kind === "result" ? -1 : 1) - (b.kind === "result" ? -1 : 1),
	);
	for (const n of order) {
		const t: Subtree = {
			count: 1,
			bytes: n.outputBytes + (n.snapshotBytes ?? 0) + ROW_BYTES,
			outputBytes: n.outputBytes,
			value: n.hits * n.execMs * recency(n.lastUsedAt, now),
			pinned: pinned.has(n.id),
		};
		for (const c of g.children.get(n.id) ?? []) {
			const s = out.get(c)!;
			t.count += s.count;
			t.bytes += s.bytes;
			t.outputBytes += s.outputBytes;
			t.value += s.value;
			t.pinned ||= s.pinned;
		}
		out.set(n.id, t);
	}
	return out;
}

/**
 * Roots of the subtrees to delete, least value per byte first, until the
 * task is within its node and output budgets. Pinned subtrees and the root
 * stay; chosen subtrees never nest.
 */
export function subtreesToEvict(
	g: Graph,
	budgets: Pick<Budgets, "nodes" | "outputBytes">,
	pinned: ReadonlySet<string>,
	now: number,
): string[] {
	const u = usageOf(g);
	if (u.nodes <= budgets.nodes && u.outputBytes <= budgets.outputBytes)
		return [];
	const totals = subtrees(g, pinned, now);
	const order = [...totals.entries()]
		.filter(([id, t]) => !t.pinned && g.nodes.get(id)!.kind !== "root")
		.sort(
			(a, b) =>
				a[1].value / a[1].bytes - b[1].value / b[1].bytes ||
				(a[0] < b[0] ? -1 : 1),
		);
	const chosen = new Set<string>();
	const within = (id: string) => {
		for (
			let p = g.nodes.get(id)!.parent;
			p !== null;
			p = g.nodes.get(p)!.parent
		) {
			if (chosen.has(p)) return true;
		}
		return false;
	};
	let { nodes, outputBytes } = u;
	for (const [id, t] of order) {
		if (nodes <= budgets.nodes && outputBytes <= budgets.outputBytes) break;
		if (within(id)) continue;
		// It may hold subtrees chosen already: it takes them over, and only
		// what it adds counts.
		let count = t.count;
		let bytes = t.outputBytes;
		for (const c of [...chosen]) {
			if (!isAncestor(g, id, c)) continue;
			const inner = totals.get(c)!;
			count -= inner.count;
			bytes -= inner.outputBytes;
			chosen.delete(c);
		}
		chosen.add(id);
		nodes -= count;
		outputBytes -= bytes;
	}
	return [...chosen];
}

function isAncestor(g: Graph, ancestor: string, id: string): boolean {
	for (
		let p = g.nodes.get(id)!.parent;
		p !== null;
		p = g.nodes.get(p)!.parent
	) {
		if (p === ancestor) return true;
	}
	return false;
}

/** Every id in the subtree under `root`, root included. */
export function subtreeIds(g: Graph, root: string): string[] {
	const out: string[] = [];
	const stack = [root];
	while (stack.length > 0) {
		const id = stack.pop()!;
		out.push(id);
		for (const c of g.children.get(id) ?? []) stack.push(c);
	}
	return out;
}
