/**
 * The v1 API's wire format: zod schemas for every request body and the types
 * of every response. The Worker validates with these; the clients take their
 * types from here, so the two cannot drift apart.
 */
import { z } from "zod";
import { ID_PATTERN } from "./ids.ts";

/** Limits on what one request may carry. */
export const LIMITS = {
	/** Calls in a lookup's history or a record's run. */
	maxCalls: 4096,
	/** Nesting depth of a call's `args`. */
	maxArgsDepth: 64,
	toolNameLength: 256,
	/** Body sizes, in bytes. */
	lookupBody: 1 << 20,
	recordBody: 32 << 20,
	adminBody: 16 << 10,
	/** A snapshot blob uploaded through the Worker. */
	snapshotBody: 512 << 20,
	graphPage: 1000,
	evictionLogPage: 1000,
	minLeaseTtlMs: 1,
} as const;

/** Nesting depth of a JSON value, bounded so that hashing cannot blow the stack. */
function depthWithin(value: unknown, max: number): boolean {
	const stack: [unknown, number][] = [[value, 0]];
	while (stack.length > 0) {
		const [v, d] = stack.pop()!;
		if (d > max) return false;
		if (v !== null && typeof v === "object") {
			for (const child of Object.values(v)) stack.push([child, d + 1]);
		}
	}
	return true;
}

/**
 * What keeps a JSON value from having one canonical form, or null. JCS
 * hashes UTF-8, and a lone surrogate has no UTF-8 form; JSON has no
 * Infinity, yet `JSON.parse` reads an out-of-range number such as 1e400 as
 * one, which nothing can serialize or hash.
 */
function notCanonical(value: unknown): string | null {
	const stack: unknown[] = [value];
	while (stack.length > 0) {
		const v = stack.pop();
		if (typeof v === "string") {
			if (!v.isWellFormed())
				return "args hold a string that is not valid Unicode";
		} else if (typeof v === "number") {
			if (!Number.isFinite(v))
				return "args hold a number out of range (JSON numbers must be finite)";
		} else if (v !== null && typeof v === "object") {
			for (const [k, child] of Object.entries(v)) {
				if (!k.isWellFormed())
					return "args hold a string that is not valid Unicode";
				stack.push(child);
			}
		}
	}
	return null;
}

export const Id = z
	.string()
	.regex(ID_PATTERN, "must be 64 lowercase hex digits");

/** A validation failure as the API reports it: the first issue, after its path. */
export function firstIssue(error: z.ZodError): string {
	const issue = error.issues[0];
	const where = issue.path.length > 0 ? `${issue.path.join(".")}: ` : "";
	return `${where}${issue.message}`;
}

/** Task names are chosen by the trainer: a dataset id, an instance id, ... */
export const TaskName = z
	.string()
	.regex(
		/^[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,199}$/,
		"1-200 characters of A-Z a-z 0-9 . _ : @ + = -, starting with a letter or digit",
	);

export const ProjectName = z
	.string()
	.regex(/^[a-z0-9][a-z0-9-]{0,62}$/, "1-63 characters of a-z 0-9 -");

const Text = z
	.string()
	.refine((s) => s.isWellFormed(), "must be valid Unicode");

export const Call = z.object({
	tool: Text.pipe(z.string().min(1).max(LIMITS.toolNameLength)),
	// Not z.json(): it checks recursively and a deeply nested body overflows
	// the stack before the depth limit is looked at. A body parsed from JSON
	// is JSON already; these two checks are iterative.
	args: z
		.unknown()
		.refine((a) => depthWithin(a, LIMITS.maxArgsDepth), {
			message: `args nest deeper than ${LIMITS.maxArgsDepth} levels`,
			abort: true,
		})
		.superRefine((a, ctx) => {
			const problem = notCanonical(a);
			if (problem !== null) ctx.addIssue({ code: "custom", message: problem });
		})
		.optional(),
	mutates: z.boolean().optional(),
});
export type Call = z.infer<typeof Call>;

/**
 * A call as a lookup sends it: with no field beyond the three, so a typo
 * such as `"mutate": false` is refused instead of silently leaving the call
 * state-changing. (Records and rollout calls extend `Call` strictly too.)
 */
const LookupCall = Call.strict();

export const LookupRequest = z
	.object({
		call: LookupCall,
		/** Every call the rollout made before `call`, in order. */
		history: z.array(LookupCall).max(LIMITS.maxCalls).optional(),
		/** Instead of the history: a state id the rollout already holds. */
		cursor: Id.optional(),
		/** Take a lease on the snapshot a miss returns (default true). */
		lease: z.boolean().optional(),
		leaseTtlMs: z.number().int().min(LIMITS.minLeaseTtlMs).optional(),
	})
	.strict()
	.refine((r) => (r.history === undefined) !== (r.cursor === undefined), {
		message: "give exactly one of history and cursor",
	});
export type LookupRequest = z.infer<typeof LookupRequest>;

export const SnapshotRef = z
	.object({
		/** The sandbox driver that can restore it: docker, workspace, sqlite, ... */
		driver: z.string().min(1).max(64),
		/** Where the blob is: an R2 key from the upload route, or the driver's own name. */
		key: z.string().min(1).max(1024),
		bytes: z.number().int().min(0),
	})
	.strict();
export type SnapshotRef = z.infer<typeof SnapshotRef>;

export const RecordedCall = Call.extend({
	output: Text,
	exitCode: z.number().int().default(0),
	execMs: z.number().min(0).max(1e9),
	/** A snapshot of the state right after this call (state-changing calls only). */
	snapshot: SnapshotRef.optional(),
}).strict();
export type RecordedCall = z.input<typeof RecordedCall>;

export const RecordRequest = z
	.object({
		/** The state the run starts at: the root id, or a state the graph holds. */
		from: Id,
		calls: z.array(RecordedCall).min(1).max(LIMITS.maxCalls),
	})
	.strict()
	.refine((r) => r.calls.every((c) => !c.snapshot || c.mutates !== false), {
		message: "only a state-changing call can carry a snapshot",
	});
export type RecordRequest = z.input<typeof RecordRequest>;

export const LeaseRequest = z
	.object({
		state: Id,
		ttlMs: z.number().int().min(LIMITS.minLeaseTtlMs).optional(),
	})
	.strict();
export const RenewRequest = z
	.object({ ttlMs: z.number().int().min(LIMITS.minLeaseTtlMs).optional() })
	.strict();

export const GraphQuery = z.object({
	after: z.coerce.number().int().min(0).optional(),
	limit: z.coerce.number().int().min(1).max(LIMITS.graphPage).default(500),
});
export const EvictionLogQuery = z.object({
	after: z.coerce.number().int().min(0).optional(),
	limit: z.coerce
		.number()
		.int()
		.min(1)
		.max(LIMITS.evictionLogPage)
		.default(500),
});
export const TaskListQuery = z.object({
	after: TaskName.optional(),
	limit: z.coerce.number().int().min(1).max(1000).default(100),
});

export const Role = z.enum(["trainer", "host", "admin"]);
export type Role = z.infer<typeof Role>;
export const CreateKeyRequest = z
	.object({
		role: Role,
		/** Only the root admin key may name a project other than its own. */
		project: ProjectName.optional(),
		name: z.string().max(200).optional(),
	})
	.strict();
export const CreateProjectRequest = z.object({ name: ProjectName }).strict();

// ---------------------------------------------------------------- responses

export interface Lease {
	id: string;
	state: string;
	/** Milliseconds since the epoch. */
	expiresAt: number;
}

export interface Hit {
	status: "hit";
	/** Only exact hits exist today; fuzzy tiers will be opt-in and labelled. */
	tier: "exact";
	/** The result id: the state after the call, or the stateless result's id. */
	id: string;
	/** The state after the call (unchanged by a stateless call). */
	state: string;
	output: string;
	exitCode: number;
	/** How long the call took when it was recorded: the time this hit saved. */
	execMs: number;
}

/** A mutating call to re-execute, in order, to rebuild the rollout's state. */
export interface ReplayCall {
	tool: string;
	args: unknown;
	/** The state after it. */
	id: string;
}

export interface Miss {
	status: "miss";
	/** The call's result id, to record under. */
	id: string;
	/** The deepest state of the rollout's path the graph holds. */
	state: string;
	/** State-changing calls matched (the depth of `state`). */
	depth: number;
	/** Where to resume: the deepest snapshot on the matched path, or none (start fresh). */
	snapshot: (SnapshotRef & { state: string; depth: number }) | null;
	/** The state to record from: the snapshot's state, or the root. */
	resume: string;
	/** The state-changing calls to execute from `resume` before the call itself. */
	replay: ReplayCall[];
	/** Held on the snapshot until released or expired; null when there is no snapshot. */
	lease: Lease | null;
}

export type LookupResponse = Hit | Miss;

export interface RecordResult {
	id: string;
	/** recorded: new; exists: same output already there; conflict: a different output stands. */
	status: "recorded" | "exists" | "conflict";
	/**
	 * The call's snapshot blob was gone (swept, or evicted before a retry):
	 * the call is recorded without a snapshot.
	 */
	snapshot?: "missing";
}
export interface RecordResponse {
	/** The state after the run: a cursor for the next lookup. */
	state: string;
	results: RecordResult[];
	conflicts: number;
}

export interface ToolStats {
	lookups: number;
	hits: number;
	misses: number;
	savedMs: number;
	records: number;
	conflicts: number;
	/** Managed mode: misses answered by another rollout's execution (single-flight). */
	coalesced: number;
	/** Oracle mode: hits re-executed by full replay, and how many differed. */
	oracleChecks: number;
	oracleMismatches: number;
	/** A recorded call of this tool once gave a different output. */
	nondeterministic: boolean;
}
export interface TaskStats {
	task: string;
	lookups: number;
	hits: number;
	misses: number;
	hitRate: number;
	savedMs: number;
	nodes: number;
	states: number;
	results: number;
	snapshots: number;
	outputBytes: number;
	snapshotBytes: number;
	leases: number;
	conflicts: number;
	coalesced: number;
	oracle: { checks: number; mismatches: number };
	/** Evictions by reason (snapshot_budget, node_budget, orphan) and bytes freed. */
	evictions: Record<string, { count: number; bytes: number }>;
	tools: Record<string, ToolStats>;
}

export interface GraphNode {
	seq: number;
	id: string;
	/** The state this node hangs under (null for the root). */
	parent: string | null;
	kind: "root" | "state" | "result";
	depth: number;
	tool: string | null;
	args: unknown;
	exitCode: number | null;
	execMs: number;
	hits: number;
	outputBytes: number;
	snapshot: SnapshotRef | null;
	/**
	 * Managed mode's selective snapshot decision for this state: the replay
	 * cost since the nearest snapshot, the snapshot + restore cost, the verdict.
	 */
	policy: { replayMs: number; costMs: number; snapshot: boolean } | null;
	/**
	 * Eviction score (value per byte; the lowest goes first): the snapshot's
	 * for a node with one, else its subtree's. Null for the root.
	 */
	score: number | null;
	createdAt: number;
}
export interface GraphPage {
	nodes: GraphNode[];
	/** Pass as `after` for the next page; null on the last. */
	next: number | null;
}

/** One thing eviction took: a node (and so its output), or a node's snapshot. */
export interface EvictionEntry {
	/** Orders the log; pass the last as `after` for what came later. */
	seq: number;
	/** The node: a state id, or a stateless call's result id. */
	id: string;
	/** `node_budget`: the node went, with its subtree; `snapshot_budget`: its snapshot did. */
	reason: "node_budget" | "snapshot_budget";
	tool: string | null;
	/** When, in ms since the epoch. */
	at: number;
}
export interface EvictionLogPage {
	evictions: EvictionEntry[];
	/** Pass as `after` for the next page; null on the last. */
	next: number | null;
	/** Older entries the log no longer holds (it keeps the newest `EVICTION_LOG_ROWS`, 50,000 by default). */
	dropped: number;
}

/** A project, as `POST /v1/projects` returns it. */
export interface Project {
	id: string;
	name: string;
}

/** An API key as created: `key` is the secret, shown only this once. */
export interface CreatedKey {
	id: string;
	key: string;
	project: string;
	role: Role;
	name: string | null;
}

/** An API key as listed: never with its secret. */
export interface KeyInfo {
	id: string;
	project: string;
	role: Role;
	name: string | null;
	createdAt: number;
	revokedAt: number | null;
}

/** One task of `GET /v1/tasks`, from the task index. */
export interface TaskInfo {
	task: string;
	createdAt: number;
	lastUsedAt: number;
	nodes: number;
	snapshots: number;
	/** Output and snapshot bytes. */
	bytes: number;
	lookups: number;
	hits: number;
}

/** A page of `GET /v1/tasks`. */
export interface TaskPage {
	tasks: TaskInfo[];
	/** Pass as `after` for the next page; null on the last. */
	next: string | null;
}

export interface ErrorBody {
	error: { code: string; message: string; details?: unknown };
}
