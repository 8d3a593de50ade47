/**
 * The task graph's SQLite schema (one database per task). Writing the layout
 * down once: see docs/storage.md.
 */
import {
	index,
	integer,
	primaryKey,
	real,
	sqliteTable,
	text,
} from "drizzle-orm/sqlite-core";

/**
 * Every node of the tool call graph. `kind` is `root` (one row, the empty
 * state), `state` (the state after a state-changing call; its id is a path
 * digest) or `result` (a stateless call's output, hung under the state it ran
 * at). `seq` orders nodes for the paginated export.
 */
export const nodes = sqliteTable(
	"nodes",
	{
		seq: integer("seq").primaryKey({ autoIncrement: true }),
		id: text("id").notNull().unique(),
		parentId: text("parent_id"),
		kind: text("kind", { enum: ["root", "state", "result"] }).notNull(),
		depth: integer("depth").notNull(),
		tool: text("tool"),
		/** The canonical JSON of the call's args. */
		args: text("args"),
		/** Inline output; null when it is in R2 at `outputKey`. */
		output: text("output"),
		outputKey: text("output_key"),
		outputBytes: integer("output_bytes").notNull().default(0),
		exitCode: integer("exit_code"),
		execMs: real("exec_ms").notNull().default(0),
		snapshotDriver: text("snapshot_driver"),
		snapshotKey: text("snapshot_key"),
		snapshotBytes: integer("snapshot_bytes"),
		hits: integer("hits").notNull().default(0),
		lastHitAt: integer("last_hit_at"),
		/** Times its snapshot was handed out to resume from, and the last time. */
		restores: integer("restores").notNull().default(0),
		lastRestoredAt: integer("last_restored_at"),
		createdAt: integer("created_at").notNull(),
		/**
		 * The selective snapshot decision made after this state was executed in
		 * managed mode: the replay cost it weighed, the snapshot + restore cost,
		 * and whether it snapshotted (null: no decision was made).
		 */
		policyReplayMs: real("policy_replay_ms"),
		policyCostMs: real("policy_cost_ms"),
		policySnapshot: integer("policy_snapshot", { mode: "boolean" }),
	},
	(t) => [
		index("nodes_parent").on(t.parentId),
		index("nodes_output_key").on(t.outputKey),
	],
);

/** Leases keep a node's snapshot from eviction until released or expired. */
export const leases = sqliteTable(
	"leases",
	{
		id: text("id").primaryKey(),
		nodeId: text("node_id").notNull(),
		expiresAt: integer("expires_at").notNull(),
		/** Set when the alarm expires it; kept a while so a renewal can say why. */
		expiredAt: integer("expired_at"),
	},
	(t) => [
		index("leases_expires").on(t.expiresAt),
		index("leases_node").on(t.nodeId),
	],
);

/** Per-tool counters; the totals are their sums. */
export const toolStats = sqliteTable("tool_stats", {
	tool: text("tool").primaryKey(),
	lookups: integer("lookups").notNull().default(0),
	hits: integer("hits").notNull().default(0),
	misses: integer("misses").notNull().default(0),
	savedMs: real("saved_ms").notNull().default(0),
	records: integer("records").notNull().default(0),
	conflicts: integer("conflicts").notNull().default(0),
	/** Misses answered by another rollout's execution of the same call (single-flight). */
	coalesced: integer("coalesced").notNull().default(0),
	/** Hits the correctness oracle re-executed, and how many differed. */
	oracleChecks: integer("oracle_checks").notNull().default(0),
	oracleMismatches: integer("oracle_mismatches").notNull().default(0),
});

/** Managed-mode rollouts: where each is, and the sandbox it holds, if any. */
export const rollouts = sqliteTable("rollouts", {
	id: text("id").primaryKey(),
	/** The template's JSON (core/host-api.ts `Template`). */
	template: text("template").notNull(),
	/** The rollout's state: the root, or a state of the graph. */
	state: text("state").notNull(),
	/** Its live sandbox: host, sandbox id, and the state the sandbox is in. */
	hostId: text("host_id"),
	sandboxId: text("sandbox_id"),
	sandboxState: text("sandbox_state"),
	oracle: integer("oracle", { mode: "boolean" }).notNull().default(false),
	calls: integer("calls").notNull().default(0),
	hits: integer("hits").notNull().default(0),
	coalesced: integer("coalesced").notNull().default(0),
	misses: integer("misses").notNull().default(0),
	savedMs: real("saved_ms").notNull().default(0),
	createdAt: integer("created_at").notNull(),
	closedAt: integer("closed_at"),
});

/** Measured sandbox costs per driver (start, restore, snapshot, pool), learned per task. */
export const costs = sqliteTable("costs", {
	/** `driver:kind`, e.g. `docker:restore`. */
	key: text("key").primaryKey(),
	ms: real("ms").notNull(),
	samples: integer("samples").notNull(),
});

/** Small facts about the task: its project and name, when it was created. */
export const meta = sqliteTable("meta", {
	key: text("key").primaryKey(),
	value: text("value").notNull(),
});

/** Evictions by reason (`snapshot_budget`, `node_budget`, `idle`, `orphan`) and bytes freed. */
export const evictions = sqliteTable("evictions", {
	reason: text("reason").primaryKey(),
	count: integer("count").notNull().default(0),
	bytes: integer("bytes").notNull().default(0),
});

/**
 * What eviction took, newest last: a node removed (`node_budget`, with its
 * whole subtree, one row a node) or a node's snapshot (`snapshot_budget`,
 * the node stays). Kept to the newest `EVICTION_LOG_ROWS` (a Worker
 * variable); `meta.eviction_log_dropped` counts the rows let go. Read through `GET /v1/tasks/{task}/evictions`.
 */
export const evictionLog = sqliteTable("eviction_log", {
	seq: integer("seq").primaryKey({ autoIncrement: true }),
	nodeId: text("node_id").notNull(),
	reason: text("reason", {
		enum: ["node_budget", "snapshot_budget"],
	}).notNull(),
	tool: text("tool"),
	at: integer("at").notNull(),
});

/**
 * Blob keys this task deleted (evicted snapshots). Keys are unique per
 * upload, so a deleted key never comes back: a retried record carrying one
 * must not attach it to a node.
 */
export const deletedBlobs = sqliteTable("deleted_blobs", {
	key: text("key").primaryKey(),
	deletedAt: integer("deleted_at").notNull(),
});

/**
 * The different outputs seen for recorded calls (invariant 3: the first
 * output stands), one row per node and output, so that the retry of a
 * conflicting record counts in stats once, as any retried record does.
 * `digest` is SHA-256 of the exit code and the output.
 */
export const conflictOutputs = sqliteTable(
	"conflict_outputs",
	{
		nodeId: text("node_id").notNull(),
		digest: text("digest").notNull(),
		seenAt: integer("seen_at").notNull(),
	},
	(t) => [primaryKey({ columns: [t.nodeId, t.digest] })],
);
