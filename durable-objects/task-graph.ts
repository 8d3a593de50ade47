/**
 * One task's tool call graph: a tree of states (path digests of
 * state-changing calls) with stateless results hung under the state they ran
 * at. SQLite (through drizzle) is the truth; an in-memory index of every node
 * is rebuilt from it on start and answers prefix matches without a query.
 *
 * Each public method is one RPC use case. The Worker computes ids before
 * calling (it needs them for its own cache), so methods take ids as given:
 * both sides are server code built from the same `core/ids.ts`.
 */
import { DurableObject } from "cloudflare:workers";
import {
	and,
	asc,
	eq,
	gt,
	inArray,
	isNotNull,
	isNull,
	lte,
	sql,
} from "drizzle-orm";
import {
	drizzle,
	type DrizzleSqliteDODatabase,
} from "drizzle-orm/durable-sqlite";
import { migrate } from "drizzle-orm/durable-sqlite/migrator";
import { createHash } from "node:crypto";
import type {
	EvictionLogPage,
	GraphPage,
	Lease,
	Miss,
	RecordResponse,
	RecordResult,
	ReplayCall,
	SnapshotRef,
	TaskStats,
	ToolStats,
} from "../core/api.ts";
import { now } from "../core/clock.ts";
import {
	graphOf,
	snapshotScores,
	snapshotsToEvict,
	subtreeIds,
	subtrees,
	subtreesToEvict,
	type Budgets,
	type EvictionNode,
	type Graph,
	type Usage,
} from "../core/eviction.ts";
import { ROOT_ID, pathIds } from "../core/ids.ts";
import type {
	OpenRolloutRequest,
	RolloutCallRequest,
	RolloutCallResponse,
	RolloutSummary,
} from "../core/managed-api.ts";
import { fail, ok, type Result } from "../core/result.ts";
import migrations from "../migrations/task-graph/migrations.js";
import { RolloutRunner, type GraphAccess, type PathNode } from "./rollouts.ts";
import * as schema from "./task-graph.schema.ts";
import {
	prepareStatements,
	TOOL_COUNTERS,
	type Statements,
} from "./task-graph.statements.ts";
import {
	conflictOutputs,
	deletedBlobs,
	evictionLog,
	evictions,
	leases,
	meta,
	nodes,
	rollouts as rolloutRows,
	toolStats,
} from "./task-graph.schema.ts";

/** What became of a snapshot managed mode took (see #attachManaged). */
export type AttachResult = "attached" | "no_node" | "has_snapshot" | "deleted";

/** What the index keeps of a node: enough to match prefixes and find snapshots. */
interface IndexNode {
	parent: string | null;
	depth: number;
	kind: "root" | "state" | "result";
	snapshot: boolean;
}

/** Which project and task this object holds; the Worker passes it on every call. */
export interface Scope {
	project: string;
	task: string;
}

/** A call with the ids the Worker computed for it. */
export interface KeyedCall {
	tool: string;
	args: unknown;
	/** State after it (state-changing) or its result id (stateless). */
	id: string;
}

export interface LookupInput {
	call: KeyedCall & { mutates: boolean };
	/** History mode: the history's state-changing calls, in order. */
	path?: KeyedCall[];
	/** Cursor mode: a state the rollout holds. */
	cursor?: string;
	lease: boolean;
	leaseTtlMs: number;
}

/** A hit as the object returns it: a large output is left in R2 for the Worker. */
export interface StoredHit {
	status: "hit";
	tier: "exact";
	id: string;
	state: string;
	output: string | null;
	outputKey: string | null;
	exitCode: number;
	execMs: number;
}

export interface RecordInput {
	from: string;
	calls: {
		tool: string;
		args: unknown;
		mutates: boolean;
		id: string;
		output: string;
		exitCode: number;
		execMs: number;
		snapshot?: SnapshotRef;
	}[];
	/** Outputs above this many UTF-8 bytes go to R2. */
	inlineMaxBytes: number;
	/** The task's budgets as the Worker resolved them (project overrides on defaults). */
	budgets?: Budgets;
}

/** What the cron asks of each task. */
export interface SweepInput {
	budgets: Budgets;
	/** Delete the task when unused this long (and nothing holds it). */
	idleTtlMs: number;
	/** Delete blobs no node points at once they are this old. */
	orphanGraceMs: number;
}

export interface SweepResult {
	deleted: boolean;
	evicted: { snapshots: number; nodes: number; orphans: number; bytes: number };
}

/** A hit served by a Worker from its own cache, counted here in batches. */
export interface EdgeHit {
	id: string;
	tool: string;
	execMs: number;
}

/** How long an expired lease is remembered, so a late renewal hears "expired". */
const EXPIRED_LEASE_MEMORY_MS = 60 * 60 * 1000;
/** How long after a change the task index in D1 is brought up to date. */
const INDEX_FLUSH_DELAY_MS = 2000;
/** Hits counted in memory before they are written regardless (see #countHit). */
const MAX_PENDING_COUNTS = 4096;
/**
 * How long a busy task's nodes' hit counts wait in memory between writes
 * (its tools' counters are written by every alarm; see #flushCounts).
 */
const NODE_HITS_WRITE_MS = 30_000;
/**
 * The most nodes' hit counts one write takes (about 20 ms of the object's
 * one thread on a 2-core machine, the row rewrites dominating); a round with
 * more goes on at the following alarms, INDEX_FLUSH_DELAY_MS apart, so a
 * task with hits on many nodes never blocks its lookups for long.
 */
const NODE_HITS_WRITE_BATCH = 2048;
/**
 * Outputs above this many UTF-8 bytes go to R2 whatever the Worker's
 * threshold: SQLite in a Durable Object refuses a row over 2 MB, and the
 * row also holds the call's args.
 */
const ROW_INLINE_MAX_BYTES = 1024 * 1024;

export class TaskGraph extends DurableObject<Env> {
	#db: DrizzleSqliteDODatabase<typeof schema>;
	/** The hot paths' statements, prepared once. */
	#q: Statements;
	#index = new Map<string, IndexNode>();
	#alarmAt: number | null = null;
	#indexDirty = false;
	#lastUsedAt = 0;
	/** What the task holds against its budgets, kept current on every change. */
	#usage: Usage = { snapshots: 0, snapshotBytes: 0, nodes: 0, outputBytes: 0 };
	#budgets: Budgets | null = null;
	#enforceDue = false;
	#rollouts: RolloutRunner;
	/** Counters not yet written: see #countHit. */
	#pendingHits: EdgeHit[] = [];
	#pendingMisses = new Map<string, number>();
	/** Hits per node counted but not yet written, and when they were counted. */
	#unwrittenNodeHits = new Map<string, { n: number; at: number }>();
	#nodeHitsWrittenAt = 0;
	/** Nodes the current round of node-hit writes has still to write (see #flushCounts). */
	#nodeHitsRoundLeft = 0;
	/** Records under way (past their first check, not yet answered). */
	#recording = 0;
	/**
	 * Output keys that records under way are writing, with how many: from
	 * before their put until after their transaction. No deletion takes one.
	 */
	#blobWrites = new Map<string, number>();
	/** Deletions sent to R2 and not yet answered, by key. */
	#blobDeletes = new Map<string, Promise<unknown>>();
	/** The budgets as last written to `meta` (JSON), to write only changes. */
	#budgetsJson: string | null = null;

	constructor(ctx: DurableObjectState, env: Env) {
		super(ctx, env);
		this.#db = drizzle(ctx.storage, { schema });
		this.#q = prepareStatements(this.#db);
		this.#rollouts = new RolloutRunner(
			this.#db,
			this.#access(),
			env.DB,
			() => this.#scopeOf()!,
			{
				warmRoots: Number(env.WARM_ROOTS ?? 0),
				warmForks: Number(env.WARM_FORKS ?? 0),
				costPriorMs: Number(env.SANDBOX_COST_PRIOR_MS ?? 250),
			},
		);
		// If the migration or the rebuild throws, the runtime resets the object
		// and the next request starts it again: a failed start does not wedge it.
		ctx.blockConcurrencyWhile(async () => {
			await migrate(this.#db, migrations);
			this.#rebuild();
			this.#alarmAt = await ctx.storage.getAlarm();
			// A record over budget arms an eviction in memory; a restart
			// before the alarm ran must not forget it.
			this.#checkBudgets();
			// Nor a change the task index in D1 has not seen yet: a task left
			// out of it is never visited by the cron, nor are its blobs swept.
			// (Not a use of the task: its idle time stands.)
			if (this.#indexBehind()) this.#indexSoon();
		});
	}

	/**
	 * Longest-prefix match of a rollout's path, then either the recorded
	 * output (a hit) or what the rollout must do to execute the call (a miss):
	 * where to resume, what to replay, and a lease on the snapshot.
	 */
	async lookup(
		scope: Scope,
		input: LookupInput,
	): Promise<Result<StoredHit | Miss>> {
		if (input.cursor !== undefined && !this.#holdsState(input.cursor)) {
			return fail(
				409,
				"stale_cursor",
				"the cursor names a state this task does not hold; look up with the full history",
			);
		}
		this.#remember(scope);
		const at = now();
		const tool = input.call.tool;
		if (this.#index.has(input.call.id)) {
			const row = this.#q.node.get({ id: input.call.id })!;
			this.#countHit(tool, row.id, row.execMs);
			this.#touch();
			return ok(this.#storedHit(row));
		}

		// The deepest held state of the path. Ids are path digests, so a held
		// state implies its whole prefix is held.
		let matched = ROOT_ID;
		if (input.cursor !== undefined) {
			matched = input.cursor;
		} else {
			const path = input.path ?? [];
			for (let i = path.length - 1; i >= 0; i--) {
				if (this.#index.has(path[i].id)) {
					matched = path[i].id;
					break;
				}
			}
		}
		const depth = this.#index.get(matched)!.depth;

		let snapshotState: string | null = null;
		for (let s: string | null = matched; s !== null;) {
			const n: IndexNode = this.#index.get(s)!;
			if (n.snapshot) {
				snapshotState = s;
				break;
			}
			s = n.parent;
		}
		const resume = snapshotState ?? ROOT_ID;

		// Replay: the held calls from the snapshot down to the matched state,
		// then (history mode) the history's calls the graph has not seen. In
		// history mode the path is the chain from the root itself (ids are
		// path digests), so the held calls come from it, not from SQLite.
		let replay: ReplayCall[];
		if (input.cursor !== undefined) {
			replay = this.#pathCalls(resume, matched);
		} else {
			const path = input.path ?? [];
			const from =
				resume === ROOT_ID ? 0 : path.findIndex((c) => c.id === resume) + 1;
			replay = path
				.slice(from)
				.map(({ tool, args, id }) => ({ tool, args, id }));
		}

		let snapshot: Miss["snapshot"] = null;
		let lease: Lease | null = null;
		if (snapshotState !== null) {
			const row = this.#q.node.get({ id: snapshotState })!;
			snapshot = {
				state: snapshotState,
				depth: row.depth,
				driver: row.snapshotDriver!,
				key: row.snapshotKey!,
				bytes: row.snapshotBytes ?? 0,
			};
			if (input.lease)
				lease = this.#grantLease(snapshotState, input.leaseTtlMs, at);
			this.#countRestore(snapshotState, at);
		}
		this.#countMiss(tool);
		this.#touch();
		return ok({
			status: "miss",
			id: input.call.id,
			state: matched,
			depth,
			snapshot,
			resume,
			replay,
			lease,
		});
	}

	/**
	 * Records a run of executed calls starting at `from`. Idempotent: a call
	 * already recorded with the same output is `exists`; with a different
	 * output it is a `conflict`, the first record stands, and the tool is
	 * flagged nondeterministic (invariant 3).
	 */
	async record(
		scope: Scope,
		input: RecordInput,
	): Promise<Result<RecordResponse>> {
		if (!this.#holdsState(input.from)) {
			return fail(
				409,
				"unknown_state",
				"`from` is neither the root nor a state this task holds",
			);
		}

		// Large outputs go to R2 first, content-addressed so that two records
		// racing for one node cannot overwrite each other's blob. Awaiting R2
		// lets other requests in, so everything below re-checks the index.
		// While the run is in flight its keys are held: eviction and the
		// sweeps leave a held key alone (see #blobInUse), and the task is not
		// idle (see #idle).
		const blobKeys = new Map<number, string>();
		const encoder = new TextEncoder();
		// A row holds at most 2 MB (the output, its args and the rest), so no
		// output near that goes inline, whatever the Worker's threshold says.
		const inlineMax = Math.min(input.inlineMaxBytes, ROW_INLINE_MAX_BYTES);
		this.#recording++;
		let outcome: Result<RecordResponse> | null = null;
		try {
			for (const [i, c] of input.calls.entries()) {
				if (this.#index.has(c.id)) continue;
				const bytes = encoder.encode(c.output);
				if (bytes.byteLength <= inlineMax) continue;
				const digest = createHash("sha256").update(bytes).digest("hex");
				const key = `outputs/${scope.project}/${scope.task}/${digest}`;
				if (!blobKeys.has(i)) this.#holdBlob(key);
				blobKeys.set(i, key);
				// A deletion of this key already sent must land before our put,
				// not after it.
				await this.#deletionOf(key);
				try {
					await this.env.BLOBS.put(key, bytes);
				} catch (err) {
					// Nothing is recorded without its output; blobs already written
					// for this run are left to the orphan sweep (they may be shared).
					console.error("R2 refused an output blob", key, err);
					return fail(
						503,
						"storage_unavailable",
						"blob storage refused a write; nothing was recorded, retry",
					);
				}
			}
			// Eviction (or an idle deletion) may have taken `from` while R2 was
			// awaited: the same answer as if it had gone before the request.
			if (!this.#holdsState(input.from)) {
				return fail(
					409,
					"unknown_state",
					"`from` is no longer a state this task holds (evicted); look up again",
				);
			}
			outcome = this.#insertRun(scope, input, blobKeys);
			return outcome;
		} finally {
			this.#recording--;
			for (const key of blobKeys.values()) this.#releaseBlob(key);
			// A blob whose node was recorded by a racing request in the meantime
			// is not needed, unless another node has the same output (or another
			// record is writing it). After a refusal the blobs stay for the
			// orphan sweep: R2 may be what failed.
			if (outcome?.ok) {
				const results = outcome.value.results;
				const unused = [...blobKeys]
					.filter(([i]) => results[i].status !== "recorded")
					.map(([, key]) => key);
				// The record has committed: a failed delete leaves an orphan for
				// the sweep, not an error for the recorder.
				await this.#deleteBlobKeys(unused).catch((err: unknown) =>
					console.error("R2 refused to delete unused output blobs", err),
				);
			}
		}
	}

	/**
	 * The synchronous half of a record: one transaction, and only once it has
	 * committed, the index and usage it changed (a transaction that throws
	 * leaves memory as it found it).
	 */
	#insertRun(
		scope: Scope,
		input: RecordInput,
		blobKeys: Map<number, string>,
	): Result<RecordResponse> {
		this.#remember(scope);
		const at = now();
		const encoder = new TextEncoder();
		const results: RecordResult[] = [];
		let conflicts = 0;
		let state = input.from;
		// What the transaction adds, in the order it adds it; the index only
		// learns it after the commit.
		const added = new Map<string, IndexNode>();
		const usage: Usage = {
			snapshots: 0,
			snapshotBytes: 0,
			nodes: 0,
			outputBytes: 0,
		};
		const attached: string[] = [];
		const lookup = (id: string) => added.get(id) ?? this.#index.get(id);
		try {
			this.ctx.storage.transactionSync(() => {
				for (const [i, c] of input.calls.entries()) {
					// A retried record may carry a snapshot ref whose blob was since
					// evicted and deleted: never point a node at it.
					const snap =
						c.snapshot && !this.#deletedBlob(c.snapshot.key)
							? c.snapshot
							: undefined;
					const parent = state;
					const parentNode = lookup(parent)!;
					const existing = lookup(c.id);
					// `records` counts nodes this record created, and `conflicts` the
					// different outputs a node was sent, so a retried record adds
					// nothing to either. Every conflicting record is told it conflicts.
					const toolDelta = { records: existing ? 0 : 1, conflicts: 0 };
					if (existing) {
						const same = this.#sameOutput(c.id, c.output, c.exitCode);
						if (!same) {
							conflicts++;
							if (this.#newConflict(c.id, c.output, c.exitCode, at))
								toolDelta.conflicts = 1;
						}
						results.push({ id: c.id, status: same ? "exists" : "conflict" });
						if (
							snap &&
							!existing.snapshot &&
							existing.kind === "state" &&
							!attached.includes(c.id)
						) {
							this.#writeSnapshot(c.id, snap);
							attached.push(c.id);
							usage.snapshots++;
							usage.snapshotBytes += snap.bytes;
						}
					} else {
						const key = blobKeys.get(i) ?? null;
						const bytes = encoder.encode(c.output).byteLength;
						// Held when the blobs were written, evicted since: its output
						// has no blob. Inline if a row takes it; else a retry writes
						// the blob.
						if (key === null && bytes > ROW_INLINE_MAX_BYTES)
							throw new EvictedMeanwhile();
						const kind = c.mutates ? "state" : "result";
						const depth = c.mutates ? parentNode.depth + 1 : parentNode.depth;
						this.#q.insertNode.run({
							id: c.id,
							parentId: parent,
							kind,
							depth,
							tool: c.tool,
							args: JSON.stringify(c.args ?? null),
							output: key === null ? c.output : null,
							outputKey: key,
							outputBytes: bytes,
							exitCode: c.exitCode,
							execMs: c.execMs,
							snapshotDriver: snap?.driver ?? null,
							snapshotKey: snap?.key ?? null,
							snapshotBytes: snap?.bytes ?? null,
							createdAt: at,
						});
						added.set(c.id, {
							parent,
							depth,
							kind,
							snapshot: snap !== undefined,
						});
						usage.nodes++;
						usage.outputBytes += bytes;
						if (snap) {
							usage.snapshots++;
							usage.snapshotBytes += snap.bytes;
						}
						results.push({ id: c.id, status: "recorded" });
					}
					this.#bumpTool(c.tool, toolDelta);
					if (c.mutates) state = c.id;
				}
				// The cron's idle check must see this record even if the object
				// restarts before its alarm writes the task index.
				this.#writeLastUsed(at);
			});
		} catch (err) {
			if (err instanceof EvictedMeanwhile) {
				return fail(
					503,
					"storage_unavailable",
					"a call was evicted while its output was written; nothing was recorded, retry",
				);
			}
			// A row past SQLite's limit (the args: the output went to R2). The
			// transaction rolled back whole, and memory was not touched.
			if (err instanceof Error && /too big|TOOBIG/i.test(err.message)) {
				return fail(
					413,
					"too_large",
					"a call's args are too large to store; nothing was recorded",
				);
			}
			throw err;
		}
		for (const [id, n] of added) this.#index.set(id, n);
		for (const id of attached) this.#index.get(id)!.snapshot = true;
		this.#usage.nodes += usage.nodes;
		this.#usage.outputBytes += usage.outputBytes;
		this.#usage.snapshots += usage.snapshots;
		this.#usage.snapshotBytes += usage.snapshotBytes;
		if (input.budgets) this.#setBudgets(input.budgets);
		this.#checkBudgets();
		this.#touch();
		return ok({ state, results, conflicts });
	}

	/** Answers with nothing read or written: a round trip to a Durable Object. */
	async ping(): Promise<true> {
		return true;
	}

	/** The recorded result with this id, counted as a hit; null if none. */
	async result(
		scope: Scope,
		id: string,
	): Promise<{ hit: StoredHit; tool: string } | null> {
		const n = this.#index.get(id);
		if (n === undefined || n.kind === "root") return null;
		this.#remember(scope);
		const row = this.#q.node.get({ id })!;
		this.#countHit(row.tool!, id, row.execMs);
		this.#touch();
		return { hit: this.#storedHit(row), tool: row.tool! };
	}

	/**
	 * A snapshot blob was uploaded for this task, maybe before any record:
	 * the task comes to exist and is indexed in D1 with the next alarm (or,
	 * after a restart, the next start), so that the cron visits it and
	 * sweeps the blob if no node ever points at it.
	 */
	async noteUpload(scope: Scope): Promise<void> {
		this.#remember(scope);
		this.#writeLastUsed(now());
		this.#touch();
	}

	/** Serves edge hits' bookkeeping: the Worker answered them from its cache. */
	async countHits(scope: Scope, hits: EdgeHit[]): Promise<void> {
		this.#remember(scope);
		for (const h of hits) this.#countHit(h.tool, h.id, h.execMs);
		this.#touch();
	}

	/** Takes a lease on a state, keeping its snapshot from eviction until it ends. */
	async acquireLease(
		scope: Scope,
		state: string,
		ttlMs: number,
	): Promise<Result<Lease>> {
		if (!this.#holdsState(state)) {
			return fail(404, "state_not_found", "this task holds no such state");
		}
		this.#remember(scope);
		return ok(this.#grantLease(state, ttlMs, now()));
	}

	/** Extends a live lease by `ttlMs` from now. */
	async renewLease(id: string, ttlMs: number): Promise<Result<Lease>> {
		const live = this.#liveLease(id);
		if (!live.ok) return live;
		const expiresAt = now() + ttlMs;
		this.#db.update(leases).set({ expiresAt }).where(eq(leases.id, id)).run();
		this.#writeLastUsed(now());
		this.#armAlarm(expiresAt);
		return ok({ id, state: live.value.nodeId, expiresAt });
	}

	/** Ends a live lease. */
	async releaseLease(
		id: string,
	): Promise<Result<{ id: string; released: true }>> {
		const live = this.#liveLease(id);
		if (!live.ok) return live;
		this.#db.delete(leases).where(eq(leases.id, id)).run();
		return ok({ id, released: true });
	}

	/** Counters for the task and for each tool; null when nothing was ever recorded. */
	async stats(scope: Scope): Promise<TaskStats | null> {
		if (this.#index.size <= 1 && this.#scopeOf() === null) return null;
		// Only the tools' counters: no figure here reads a node's hits.
		this.#flushCounts("none");
		const tools: Record<string, ToolStats> = {};
		const total = {
			lookups: 0,
			hits: 0,
			misses: 0,
			savedMs: 0,
			conflicts: 0,
			coalesced: 0,
			oracleChecks: 0,
			oracleMismatches: 0,
		};
		for (const t of this.#db.select().from(toolStats).all()) {
			tools[t.tool] = {
				lookups: t.lookups,
				hits: t.hits,
				misses: t.misses,
				savedMs: t.savedMs,
				records: t.records,
				conflicts: t.conflicts,
				coalesced: t.coalesced,
				oracleChecks: t.oracleChecks,
				oracleMismatches: t.oracleMismatches,
				nondeterministic: t.conflicts > 0,
			};
			total.lookups += t.lookups;
			total.hits += t.hits;
			total.misses += t.misses;
			total.savedMs += t.savedMs;
			total.conflicts += t.conflicts;
			total.coalesced += t.coalesced;
			total.oracleChecks += t.oracleChecks;
			total.oracleMismatches += t.oracleMismatches;
		}
		const agg = this.#db
			.select({
				nodes: sql<number>`count(*)`,
				states: sql<number>`sum(${nodes.kind} = 'state')`,
				results: sql<number>`sum(${nodes.kind} = 'result')`,
				snapshots: sql<number>`count(${nodes.snapshotKey})`,
				outputBytes: sql<number>`coalesce(sum(${nodes.outputBytes}), 0)`,
				snapshotBytes: sql<number>`coalesce(sum(${nodes.snapshotBytes}), 0)`,
			})
			.from(nodes)
			.get()!;
		const live = this.#db
			.select({ n: sql<number>`count(*)` })
			.from(leases)
			.where(and(isNull(leases.expiredAt), gt(leases.expiresAt, now())))
			.get()!;
		return {
			task: scope.task,
			lookups: total.lookups,
			hits: total.hits,
			misses: total.misses,
			hitRate: total.lookups === 0 ? 0 : total.hits / total.lookups,
			savedMs: total.savedMs,
			nodes: agg.nodes,
			states: agg.states ?? 0,
			results: agg.results ?? 0,
			snapshots: agg.snapshots,
			outputBytes: agg.outputBytes,
			snapshotBytes: agg.snapshotBytes,
			leases: live.n,
			conflicts: total.conflicts,
			coalesced: total.coalesced,
			oracle: {
				checks: total.oracleChecks,
				mismatches: total.oracleMismatches,
			},
			evictions: Object.fromEntries(
				this.#db
					.select()
					.from(evictions)
					.all()
					.map((e) => [e.reason, { count: e.count, bytes: e.bytes }]),
			),
			tools,
		};
	}

	/** One page of the tree in creation order (parents before children). */
	async graph(after: number, limit: number): Promise<GraphPage | null> {
		if (this.#index.size <= 1 && this.#scopeOf() === null) return null;
		this.#flushCounts();
		const rows = this.#db
			.select()
			.from(nodes)
			.where(gt(nodes.seq, after))
			.orderBy(asc(nodes.seq))
			.limit(limit + 1)
			.all();
		const page = rows.slice(0, limit);
		// Scores need the whole tree; computed per page, which is O(nodes).
		const at = now();
		const g = this.#evictionGraph();
		const snapScores = snapshotScores(g, at);
		const trees = subtrees(g, this.#pinned(at, true), at);
		const score = (id: string, kind: string): number | null => {
			if (kind === "root") return null;
			const s = snapScores.get(id);
			if (s !== undefined) return s;
			const t = trees.get(id);
			return t ? t.value / t.bytes : null;
		};
		return {
			nodes: page.map((r) => ({
				seq: r.seq,
				id: r.id,
				parent: r.parentId,
				kind: r.kind,
				depth: r.depth,
				tool: r.tool,
				args: r.args === null ? null : JSON.parse(r.args),
				exitCode: r.exitCode,
				execMs: r.execMs,
				hits: r.hits,
				outputBytes: r.outputBytes,
				snapshot:
					r.snapshotKey === null
						? null
						: {
								driver: r.snapshotDriver!,
								key: r.snapshotKey,
								bytes: r.snapshotBytes ?? 0,
							},
				policy:
					r.policySnapshot === null
						? null
						: {
								replayMs: r.policyReplayMs ?? 0,
								costMs: r.policyCostMs ?? 0,
								snapshot: r.policySnapshot,
							},
				score: score(r.id, r.kind),
				createdAt: r.createdAt,
			})),
			next: rows.length > limit ? page[page.length - 1].seq : null,
		};
	}

	/** Opens a managed-mode rollout of this task at the root. */
	async openRollout(
		scope: Scope,
		req: OpenRolloutRequest,
	): Promise<Result<RolloutSummary>> {
		this.#remember(scope);
		return this.#rollouts.open(req);
	}

	/** One tool call of a managed rollout: answered from the graph or executed on a host. */
	async rolloutCall(
		scope: Scope,
		rollout: string,
		req: RolloutCallRequest,
	): Promise<Result<RolloutCallResponse>> {
		// A refused call (no such rollout, closed, busy) leaves no trace.
		if (!this.#rollouts.get(rollout).ok)
			return this.#rollouts.call(rollout, req);
		this.#remember(scope);
		const r = await this.#rollouts.call(rollout, req);
		this.#touch();
		return r;
	}

	/** A rollout's position and counters. */
	async rollout(rollout: string): Promise<Result<RolloutSummary>> {
		return this.#rollouts.get(rollout);
	}

	/** Closes a rollout, stopping its sandbox. */
	async closeRollout(rollout: string): Promise<Result<RolloutSummary>> {
		return this.#rollouts.close(rollout);
	}

	/** Whether the task holds a state (the snapshot routes ask before storing). */
	async hasState(state: string): Promise<boolean> {
		return this.#holdsState(state);
	}

	/** The R2 key of the snapshot a state's node points at, if any. */
	async snapshotKey(state: string): Promise<string | null> {
		if (!this.#index.get(state)?.snapshot) return null;
		const row = this.#db
			.select({ key: nodes.snapshotKey })
			.from(nodes)
			.where(eq(nodes.id, state))
			.get();
		return row?.key ?? null;
	}

	/**
	 * Expires due leases, forgets long-expired ones and brings the task index
	 * in D1 up to date. Idempotent: running it twice leaves the same state.
	 */
	async alarm(): Promise<void> {
		this.#alarmAt = null;
		const at = now();
		this.#flushCounts("when due");
		this.#expireLeases(at);
		if (this.#enforceDue) await this.#enforce(this.#budgetsOrDefault(), at);
		if (this.#indexDirty) await this.#flushIndex(at);

		const next = this.#db
			.select({
				live: sql<
					number | null
				>`min(case when ${leases.expiredAt} is null then ${leases.expiresAt} end)`,
				forget: sql<number | null>`min(${leases.expiredAt})`,
			})
			.from(leases)
			.get()!;
		const due = [
			next.live,
			next.forget === null ? null : next.forget + EXPIRED_LEASE_MEMORY_MS,
			this.#indexDirty ? at + INDEX_FLUSH_DELAY_MS : null,
			this.#nodeHitsRoundLeft > 0
				? at + INDEX_FLUSH_DELAY_MS
				: this.#unwrittenNodeHits.size > 0
					? this.#nodeHitsWrittenAt + NODE_HITS_WRITE_MS
					: null,
		].filter((t): t is number => t !== null);
		if (due.length > 0) this.#armAlarm(Math.min(...due));
	}

	/**
	 * The cron's per-task work: expire leases; delete the task if it has been
	 * idle past the TTL with nothing holding it; else enforce its budgets and
	 * delete blobs that no node points at. Safe to run twice at once: the
	 * idle check and the deletion run as one step that no other request
	 * interleaves with (a second sweep then finds nothing to delete), and
	 * every other step is idempotent.
	 */
	async sweep(input: SweepInput): Promise<SweepResult> {
		const at = now();
		this.#expireLeases(at);
		const evicted = { snapshots: 0, nodes: 0, orphans: 0, bytes: 0 };
		const scope = this.#scopeOf();
		if (scope === null) return { deleted: false, evicted };
		this.#setBudgets(input.budgets);
		if (this.#idle(at, input.idleTtlMs)) {
			// Deleting awaits R2 and D1. Inside blockConcurrencyWhile no other
			// request is delivered until it is done, so none can record into
			// (or lease from) the task between the decision and the deletion;
			// one delivered before it and still under way (a record awaiting
			// R2) keeps the task from being idle at all. Holding the gate
			// across R2 is what the constructor must not do; here the task has
			// been unused for the whole TTL, so nothing is kept waiting.
			const bytes = await this.ctx.blockConcurrencyWhile(async () =>
				this.#idle(now(), input.idleTtlMs) ? this.#deleteTask(scope) : null,
			);
			if (bytes !== null) {
				evicted.bytes = bytes;
				return { deleted: true, evicted };
			}
		}
		Object.assign(evicted, await this.#enforce(input.budgets, at));
		const orphans = await this.#sweepOrphans(scope, at - input.orphanGraceMs);
		evicted.orphans = orphans.count;
		evicted.bytes += orphans.bytes;
		return { deleted: false, evicted };
	}

	/** Enforces the task's budgets now (the alarm does this after records that overflow). */
	async enforce(budgets: Budgets): Promise<SweepResult["evicted"]> {
		this.#setBudgets(budgets);
		return { ...(await this.#enforce(budgets, now())), orphans: 0 };
	}

	// ------------------------------------------------------------ internals

	/** What the rollout runner may do to the graph. */
	#access(): GraphAccess {
		return {
			has: (id) => this.#index.has(id),
			stored: (id) => {
				const n = this.#index.get(id);
				if (n === undefined || n.kind === "root") return null;
				const row = this.#q.node.get({ id })!;
				return { hit: this.#storedHit(row), tool: row.tool! };
			},
			output: async (hit) => {
				if (hit.output !== null) return hit.output;
				const blob = await this.env.BLOBS.get(hit.outputKey!);
				if (!blob) throw new Error(`output blob ${hit.outputKey} is missing`);
				return blob.text();
			},
			countHit: (tool, id, execMs) => this.#countHit(tool, id, execMs),
			countRestore: (id) => this.#countRestore(id, now()),
			countMiss: (tool) => this.#countMiss(tool),
			countCoalesced: (tool) =>
				this.#bumpTool(tool, { lookups: 1, coalesced: 1 }),
			countOracle: (tool, mismatch) =>
				this.#bumpTool(tool, {
					oracleChecks: 1,
					oracleMismatches: mismatch ? 1 : 0,
				}),
			path: (state) => this.#pathNodes(state),
			record: (scope, from, calls) => {
				const steps = pathIds(calls, from);
				return this.record(scope, {
					from,
					calls: calls.map((c, i) => ({ ...c, id: steps[i].id })),
					inlineMaxBytes: Number(this.env.OUTPUT_INLINE_MAX_BYTES),
				});
			},
			notePolicy: (id, d) => {
				this.#db
					.update(nodes)
					.set({
						policyReplayMs: d.replayMs,
						policyCostMs: d.costMs,
						policySnapshot: d.snapshot,
					})
					.where(eq(nodes.id, id))
					.run();
			},
			attachSnapshot: (id, ref) => this.#attachManaged(id, ref),
		};
	}

	/** The held states from the root (exclusive) down to `state`, with calls and snapshots. */
	#pathNodes(state: string): PathNode[] {
		const ids: string[] = [];
		for (let s: string | null = state; s !== null && s !== ROOT_ID;) {
			ids.push(s);
			s = this.#index.get(s)!.parent;
		}
		ids.reverse();
		return ids.map((id) => {
			const r = this.#db.select().from(nodes).where(eq(nodes.id, id)).get()!;
			return {
				id,
				tool: r.tool!,
				args: JSON.parse(r.args ?? "null"),
				execMs: r.execMs,
				snapshot:
					r.snapshotKey === null
						? null
						: {
								driver: r.snapshotDriver!,
								key: r.snapshotKey,
								bytes: r.snapshotBytes ?? 0,
							},
			};
		});
	}

	// ------------------------------------------------------------ eviction

	#countRestore(id: string, at: number): void {
		this.#db
			.update(nodes)
			.set({ restores: sql`${nodes.restores} + 1`, lastRestoredAt: at })
			.where(eq(nodes.id, id))
			.run();
	}

	/**
	 * Keeps the budgets last given, in memory and in `meta`: after a restart
	 * the alarm must still evict by the project's budgets, not the defaults.
	 */
	#setBudgets(b: Budgets): void {
		this.#budgets = b;
		const json = JSON.stringify(b);
		if (json === this.#budgetsJson) return;
		this.#budgetsJson = json;
		this.#setMeta("budgets", json);
	}

	/** The budgets last given (by a record or the cron), else the Worker's defaults. */
	#budgetsOrDefault(): Budgets {
		return (
			this.#budgets ?? {
				snapshots: Number(this.env.BUDGET_SNAPSHOTS),
				snapshotBytes: Number(this.env.BUDGET_SNAPSHOT_BYTES),
				nodes: Number(this.env.BUDGET_NODES),
				outputBytes: Number(this.env.BUDGET_OUTPUT_BYTES),
				tasks: Number(this.env.QUOTA_TASKS),
				projectBytes: Number(this.env.QUOTA_BYTES),
			}
		);
	}

	/** Over a budget: evict from the alarm, off the request that overflowed it. */
	#checkBudgets(): void {
		const b = this.#budgetsOrDefault();
		const u = this.#usage;
		if (
			u.snapshots > b.snapshots ||
			u.snapshotBytes > b.snapshotBytes ||
			u.nodes > b.nodes ||
			u.outputBytes > b.outputBytes
		) {
			this.#enforceDue = true;
			this.#armAlarm(now());
		}
	}

	/**
	 * What eviction must not touch: nodes with live leases, and (for
	 * subtrees) the states open rollouts are at or hold a sandbox in.
	 */
	#pinned(at: number, withRollouts: boolean): Set<string> {
		const pinned = new Set(
			this.#db
				.select({ id: leases.nodeId })
				.from(leases)
				.where(and(isNull(leases.expiredAt), gt(leases.expiresAt, at)))
				.all()
				.map((r) => r.id),
		);
		if (withRollouts) {
			for (const r of this.#db
				.select({ state: rolloutRows.state, sandbox: rolloutRows.sandboxState })
				.from(rolloutRows)
				.where(isNull(rolloutRows.closedAt))
				.all()) {
				pinned.add(r.state);
				if (r.sandbox !== null) pinned.add(r.sandbox);
			}
		}
		return pinned;
	}

	#evictionGraph(): Graph {
		const rows = this.#db
			.select({
				id: nodes.id,
				parent: nodes.parentId,
				depth: nodes.depth,
				kind: nodes.kind,
				execMs: nodes.execMs,
				hits: nodes.hits,
				restores: nodes.restores,
				lastHitAt: nodes.lastHitAt,
				lastRestoredAt: nodes.lastRestoredAt,
				createdAt: nodes.createdAt,
				outputBytes: nodes.outputBytes,
				snapshotKey: nodes.snapshotKey,
				snapshotBytes: nodes.snapshotBytes,
			})
			.from(nodes)
			.all();
		return graphOf(
			rows.map((r): EvictionNode => ({
				id: r.id,
				parent: r.parent,
				depth: r.depth,
				kind: r.kind,
				execMs: r.execMs,
				hits: r.hits,
				restores: r.restores,
				lastUsedAt: Math.max(
					r.lastHitAt ?? 0,
					r.lastRestoredAt ?? 0,
					r.createdAt,
				),
				outputBytes: r.outputBytes,
				snapshotBytes: r.snapshotKey === null ? null : (r.snapshotBytes ?? 0),
			})),
		);
	}

	/**
	 * Evicts snapshots, then subtrees, least valuable first, until the task
	 * is within its budgets. The rows go in one transaction; their blobs are
	 * deleted after it, so no node ever points at a deleted blob (a crash in
	 * between leaves orphans, which the sweep deletes). A blob goes only when
	 * no remaining node points at it: two nodes of a task may share a
	 * snapshot blob, and outputs are content-addressed.
	 */
	async #enforce(
		budgets: Budgets,
		at: number,
	): Promise<{ snapshots: number; nodes: number; bytes: number }> {
		this.#enforceDue = false;
		this.#flushCounts();
		const g = this.#evictionGraph();
		const dropSnapshots = snapshotsToEvict(
			g,
			budgets,
			this.#pinned(at, false),
			at,
		);
		for (const id of dropSnapshots) g.nodes.get(id)!.snapshotBytes = null;
		const dropTrees = subtreesToEvict(g, budgets, this.#pinned(at, true), at);
		const dropNodes = dropTrees.flatMap((root) => subtreeIds(g, root));
		if (dropSnapshots.length === 0 && dropNodes.length === 0) {
			return { snapshots: 0, nodes: 0, bytes: 0 };
		}

		const blobKeys: string[] = [];
		let snapshotBytesFreed = 0;
		let nodeBytesFreed = 0;
		this.ctx.storage.transactionSync(() => {
			const snapshotKeys = new Set<string>();
			for (const ids of chunks(dropSnapshots, SQL_IDS)) {
				const rows = this.#db
					.select({
						id: nodes.id,
						tool: nodes.tool,
						key: nodes.snapshotKey,
						bytes: nodes.snapshotBytes,
					})
					.from(nodes)
					.where(inArray(nodes.id, ids))
					.all();
				for (const r of rows) {
					if (r.key?.startsWith("snapshots/")) snapshotKeys.add(r.key);
					snapshotBytesFreed += r.bytes ?? 0;
				}
				this.#logEvictions("snapshot_budget", rows, at);
				this.#db
					.update(nodes)
					.set({ snapshotDriver: null, snapshotKey: null, snapshotBytes: null })
					.where(inArray(nodes.id, ids))
					.run();
			}
			const outputKeys = new Set<string>();
			for (const ids of chunks(dropNodes, SQL_IDS)) {
				const rows = this.#db
					.select({
						id: nodes.id,
						tool: nodes.tool,
						outputKey: nodes.outputKey,
						outputBytes: nodes.outputBytes,
						snapshotKey: nodes.snapshotKey,
						snapshotBytes: nodes.snapshotBytes,
					})
					.from(nodes)
					.where(inArray(nodes.id, ids))
					.all();
				for (const r of rows) {
					if (r.outputKey) outputKeys.add(r.outputKey);
					if (r.snapshotKey?.startsWith("snapshots/"))
						snapshotKeys.add(r.snapshotKey);
					nodeBytesFreed += r.outputBytes + (r.snapshotBytes ?? 0);
				}
				this.#logEvictions("node_budget", rows, at);
				this.#db.delete(nodes).where(inArray(nodes.id, ids)).run();
				this.#db.delete(leases).where(inArray(leases.nodeId, ids)).run();
			}
			// A snapshot blob another node still points at stays, and so does
			// whatever lease covers that node. (snapshot_key has no index: one
			// scan per SQL_IDS keys, on eviction only.)
			for (const keys of chunks([...snapshotKeys], SQL_IDS)) {
				for (const r of this.#db
					.select({ key: nodes.snapshotKey })
					.from(nodes)
					.where(inArray(nodes.snapshotKey, keys))
					.all())
					snapshotKeys.delete(r.key!);
			}
			for (const key of snapshotKeys) {
				this.#buryBlob(key, at);
				blobKeys.push(key);
			}
			// Outputs are content-addressed: keep a blob another node still uses.
			for (const key of outputKeys) {
				const used = this.#db
					.select({ seq: nodes.seq })
					.from(nodes)
					.where(eq(nodes.outputKey, key))
					.get();
				if (!used) blobKeys.push(key);
			}
			if (dropSnapshots.length > 0)
				this.#bumpEviction(
					"snapshot_budget",
					dropSnapshots.length,
					snapshotBytesFreed,
				);
			if (dropNodes.length > 0)
				this.#bumpEviction("node_budget", dropNodes.length, nodeBytesFreed);
		});
		// Committed: only now does memory follow.
		for (const id of dropSnapshots) {
			const n = this.#index.get(id);
			if (n) n.snapshot = false;
		}
		for (const id of dropNodes) this.#index.delete(id);
		this.#usage = this.#measureUsage();
		// Records run during these awaits: #deleteBlobKeys checks each batch
		// again right before sending it.
		await this.#deleteBlobKeys(blobKeys);
		// The index's counts changed; the task was not used: an eviction
		// must not put off its idle expiry.
		this.#indexSoon();
		return {
			snapshots: dropSnapshots.length,
			nodes: dropNodes.length,
			bytes: snapshotBytesFreed + nodeBytesFreed,
		};
	}

	/** Blobs under this task's prefixes that no node points at, older than `before`. */
	async #sweepOrphans(
		scope: Scope,
		before: number,
	): Promise<{ count: number; bytes: number }> {
		const freed = await this.#deleteBlobs(scope, (o) => {
			if (o.uploaded.getTime() >= before) return false;
			if (this.#blobInUse(o.key)) return false;
			this.#buryBlob(o.key, before);
			return true;
		});
		if (freed.count > 0) this.#bumpEviction("orphan", freed.count, freed.bytes);
		return freed;
	}

	/**
	 * Pages through the task's two R2 prefixes and deletes the blobs `pick`
	 * chooses (synchronously: it may read and write rows, but not await, so
	 * that what it checks still holds when the deletion is sent).
	 */
	async #deleteBlobs(
		scope: Scope,
		pick: (o: R2Object) => boolean,
	): Promise<{ count: number; bytes: number }> {
		let count = 0;
		let bytes = 0;
		for (const kind of ["outputs", "snapshots"] as const) {
			const prefix = `${kind}/${scope.project}/${scope.task}/`;
			let cursor: string | undefined;
			do {
				const page = await this.env.BLOBS.list({ prefix, cursor, limit: 1000 });
				const doomed = page.objects.filter((o) => pick(o));
				if (doomed.length > 0) {
					await this.#sendDeletion(doomed.map((o) => o.key));
					count += doomed.length;
					bytes += doomed.reduce((n, o) => n + o.size, 0);
				}
				cursor = page.truncated ? page.cursor : undefined;
			} while (cursor);
		}
		return { count, bytes };
	}

	/**
	 * Deletes blobs that nothing used when the caller chose them, leaving an
	 * output key a record has since started writing or a node has since come
	 * to point at. Checked per batch right before the batch is sent: between
	 * batches (awaits) records run. Snapshot keys are not checked again: the
	 * caller buried them, and no node takes a buried key.
	 */
	async #deleteBlobKeys(keys: string[]): Promise<void> {
		for (const batch of chunks([...new Set(keys)], 1000)) {
			const doomed = batch.filter(
				(k) => !k.startsWith("outputs/") || !this.#blobInUse(k),
			);
			if (doomed.length > 0) await this.#sendDeletion(doomed);
		}
	}

	/**
	 * Whether a blob is in use: a record under way is writing it, or a node
	 * points at it. Outputs are content-addressed, so a key no node uses
	 * now can be wanted again by the next record; snapshot keys are unique
	 * per upload, and an evicted one is buried before its deletion, so no
	 * node can come to point at it afterwards.
	 */
	#blobInUse(key: string): boolean {
		if (this.#blobWrites.has(key)) return true;
		const column = key.startsWith("outputs/")
			? nodes.outputKey
			: nodes.snapshotKey;
		return (
			this.#db
				.select({ seq: nodes.seq })
				.from(nodes)
				.where(eq(column, key))
				.get() !== undefined
		);
	}

	/**
	 * Sends one R2 deletion, remembered until it is answered: a record about
	 * to put one of its keys waits for it (see #deletionOf), so the put can
	 * never land first and be deleted.
	 */
	async #sendDeletion(keys: string[]): Promise<void> {
		const sent = this.env.BLOBS.delete(keys);
		for (const k of keys) this.#blobDeletes.set(k, sent);
		try {
			await sent;
		} finally {
			for (const k of keys)
				if (this.#blobDeletes.get(k) === sent) this.#blobDeletes.delete(k);
		}
	}

	/** Resolves once no deletion of `key` is in flight. */
	async #deletionOf(key: string): Promise<void> {
		for (let d = this.#blobDeletes.get(key); d; d = this.#blobDeletes.get(key))
			await d.catch(() => undefined);
	}

	#holdBlob(key: string): void {
		this.#blobWrites.set(key, (this.#blobWrites.get(key) ?? 0) + 1);
	}

	#releaseBlob(key: string): void {
		const n = (this.#blobWrites.get(key) ?? 1) - 1;
		if (n > 0) this.#blobWrites.set(key, n);
		else this.#blobWrites.delete(key);
	}

	/**
	 * Unused for longer than `ttlMs`, with nothing holding it: no live lease,
	 * no open rollout, no record under way.
	 */
	#idle(at: number, ttlMs: number): boolean {
		return (
			at - this.#lastUsed() > ttlMs &&
			this.#recording === 0 &&
			this.#pinned(at, true).size === 0
		);
	}

	/** When the task was last used: in memory, else as last written, else its creation. */
	#lastUsed(): number {
		const m = Object.fromEntries(
			this.#db
				.select()
				.from(meta)
				.where(inArray(meta.key, ["last_used_at", "created_at"]))
				.all()
				.map((r) => [r.key, Number(r.value)]),
		);
		return Math.max(this.#lastUsedAt, m.last_used_at ?? 0, m.created_at ?? 0);
	}

	/**
	 * Deletes everything the task holds: its rows, its blobs, its index
	 * entry. The caller holds the object's gate (see sweep). The rows go
	 * first, so that an object reset part way (blockConcurrencyWhile gives
	 * up after 30 s) never leaves a node pointing at a deleted blob: `meta`
	 * stays until the blobs are gone, so the task is still indexed, still
	 * idle, and the next sweep finishes the work (or, if it was used since,
	 * sweeps the blobs left as orphans).
	 */
	async #deleteTask(scope: Scope): Promise<number> {
		this.ctx.storage.transactionSync(() => {
			for (const table of [
				nodes,
				leases,
				toolStats,
				rolloutRows,
				evictions,
				evictionLog,
				deletedBlobs,
				conflictOutputs,
			]) {
				this.#db.delete(table).run();
			}
			this.#db
				.delete(meta)
				.where(inArray(meta.key, ["budgets", "eviction_log_dropped"]))
				.run();
		});
		this.#pendingHits = [];
		this.#pendingMisses = new Map();
		this.#unwrittenNodeHits.clear();
		this.#nodeHitsRoundLeft = 0;
		this.#budgets = null;
		this.#budgetsJson = null;
		this.#enforceDue = false;
		this.#rebuild();
		const { bytes } = await this.#deleteBlobs(scope, () => true);
		await this.env.DB.prepare(
			"delete from tasks where project_id = ?1 and task = ?2",
		)
			.bind(scope.project, scope.task)
			.run();
		this.#db.delete(meta).run();
		this.#scope = null;
		this.#lastUsedAt = 0;
		this.#indexDirty = false;
		return bytes;
	}

	/** Remembers a deleted snapshot key (unique per upload, so for good). */
	#buryBlob(key: string, at: number): void {
		if (!key.startsWith("snapshots/")) return;
		this.#db
			.insert(deletedBlobs)
			.values({ key, deletedAt: at })
			.onConflictDoNothing()
			.run();
	}

	#deletedBlob(key: string): boolean {
		return (
			this.#db
				.select({ key: deletedBlobs.key })
				.from(deletedBlobs)
				.where(eq(deletedBlobs.key, key))
				.get() !== undefined
		);
	}

	/**
	 * Adds what eviction took to the log (in the eviction's transaction),
	 * then lets the oldest rows past the log's size go, counting them.
	 */
	#logEvictions(
		reason: "node_budget" | "snapshot_budget",
		rows: { id: string; tool: string | null }[],
		at: number,
	): void {
		if (rows.length === 0) return;
		// One statement a chunk: a Durable Object takes at most 100 bound
		// parameters a statement, and the rows travel as one JSON array.
		this.#db.run(
			sql`insert into ${evictionLog} (node_id, reason, tool, at) select r.value ->> 0, ${reason}, r.value ->> 1, ${at} from json_each(${JSON.stringify(rows.map((r) => [r.id, r.tool]))}) as r`,
		);
		// EVICTION_LOG_ROWS (wrangler.toml; 50,000 rows of about 100 bytes):
		// what a task over its node budget evicts in a long while, little
		// next to the nodes themselves.
		const keep = Number(this.env.EVICTION_LOG_ROWS) || 50_000;
		const cut = this.ctx.storage.sql.exec(
			"delete from eviction_log where seq <= (select max(seq) from eviction_log) - ?",
			keep,
		).rowsWritten;
		if (cut > 0) {
			const before = Number(
				this.#db
					.select({ value: meta.value })
					.from(meta)
					.where(eq(meta.key, "eviction_log_dropped"))
					.get()?.value ?? 0,
			);
			this.#setMeta("eviction_log_dropped", String(before + cut));
		}
	}

	/**
	 * The eviction log from after `after` (a row's `seq`), oldest first;
	 * null for a task that holds nothing, as {@link graph}.
	 */
	async evictionLog(
		after: number,
		limit: number,
	): Promise<EvictionLogPage | null> {
		if (this.#index.size <= 1 && this.#scopeOf() === null) return null;
		const rows = this.#db
			.select()
			.from(evictionLog)
			.where(gt(evictionLog.seq, after))
			.orderBy(asc(evictionLog.seq))
			.limit(limit + 1)
			.all();
		const page = rows.slice(0, limit);
		const dropped = this.#db
			.select({ value: meta.value })
			.from(meta)
			.where(eq(meta.key, "eviction_log_dropped"))
			.get();
		return {
			evictions: page.map((r) => ({
				seq: r.seq,
				id: r.nodeId,
				reason: r.reason,
				tool: r.tool,
				at: r.at,
			})),
			next: rows.length > limit ? page[page.length - 1]!.seq : null,
			dropped: Number(dropped?.value ?? 0),
		};
	}

	#bumpEviction(reason: string, count: number, bytes: number): void {
		this.#db
			.insert(evictions)
			.values({ reason, count, bytes })
			.onConflictDoUpdate({
				target: evictions.reason,
				set: {
					count: sql`${evictions.count} + ${count}`,
					bytes: sql`${evictions.bytes} + ${bytes}`,
				},
			})
			.run();
	}

	#measureUsage(): Usage {
		const u = this.#db
			.select({
				nodes: sql<number>`count(*)`,
				outputBytes: sql<number>`coalesce(sum(${nodes.outputBytes}), 0)`,
				snapshots: sql<number>`count(${nodes.snapshotKey})`,
				snapshotBytes: sql<number>`coalesce(sum(case when ${nodes.snapshotKey} is not null then ${nodes.snapshotBytes} end), 0)`,
			})
			.from(nodes)
			.get()!;
		return u;
	}

	/** A state, not a stateless result: only states have children and snapshots. */
	#holdsState(id: string): boolean {
		const n = this.#index.get(id);
		return n !== undefined && n.kind !== "result";
	}

	#expireLeases(at: number): void {
		this.#db
			.update(leases)
			.set({ expiredAt: at })
			.where(and(isNull(leases.expiredAt), lte(leases.expiresAt, at)))
			.run();
		this.#db
			.delete(leases)
			.where(
				and(
					isNotNull(leases.expiredAt),
					lte(leases.expiredAt, at - EXPIRED_LEASE_MEMORY_MS),
				),
			)
			.run();
	}

	#rebuild(): void {
		this.#index.clear();
		this.#usage = { snapshots: 0, snapshotBytes: 0, nodes: 0, outputBytes: 0 };
		const hasRoot = this.#db
			.select()
			.from(nodes)
			.where(eq(nodes.id, ROOT_ID))
			.get();
		if (!hasRoot) {
			this.#db
				.insert(nodes)
				.values({
					id: ROOT_ID,
					parentId: null,
					kind: "root",
					depth: 0,
					createdAt: now(),
				})
				.run();
		}
		const rows = this.#db
			.select({
				id: nodes.id,
				parent: nodes.parentId,
				depth: nodes.depth,
				kind: nodes.kind,
				snapshotKey: nodes.snapshotKey,
			})
			.from(nodes)
			.all();
		for (const r of rows) {
			this.#index.set(r.id, {
				parent: r.parent,
				depth: r.depth,
				kind: r.kind,
				snapshot: r.snapshotKey !== null,
			});
		}
		this.#usage = this.#measureUsage();
		const saved = this.#db
			.select()
			.from(meta)
			.where(inArray(meta.key, ["budgets", "last_used_at"]))
			.all();
		for (const r of saved) {
			if (r.key === "budgets") {
				this.#budgets = JSON.parse(r.value) as Budgets;
				this.#budgetsJson = r.value;
			} else this.#lastUsedAt = Math.max(this.#lastUsedAt, Number(r.value));
		}
	}

	/** The held state-changing calls strictly below `from`, down to `to`. */
	#pathCalls(from: string, to: string): ReplayCall[] {
		const ids: string[] = [];
		for (let s: string | null = to; s !== null && s !== from;) {
			ids.push(s);
			s = this.#index.get(s)!.parent;
		}
		ids.reverse();
		return ids.map((id) => {
			const r = this.#q.call.get({ id })!;
			return { tool: r.tool!, args: JSON.parse(r.args ?? "null"), id };
		});
	}

	#storedHit(row: typeof nodes.$inferSelect): StoredHit {
		return {
			status: "hit",
			tier: "exact",
			id: row.id,
			state: row.kind === "result" ? row.parentId! : row.id,
			output: row.output,
			outputKey: row.outputKey,
			exitCode: row.exitCode ?? 0,
			execMs: row.execMs,
		};
	}

	#sameOutput(id: string, output: string, exitCode: number): boolean {
		const r = this.#db
			.select({
				output: nodes.output,
				outputKey: nodes.outputKey,
				exitCode: nodes.exitCode,
			})
			.from(nodes)
			.where(eq(nodes.id, id))
			.get()!;
		if ((r.exitCode ?? 0) !== exitCode) return false;
		if (r.outputKey !== null) {
			const digest = createHash("sha256").update(output, "utf8").digest("hex");
			return r.outputKey.endsWith(`/${digest}`);
		}
		return r.output === output;
	}

	/** Notes a different output sent for a node; false if it was sent before. */
	#newConflict(
		id: string,
		output: string,
		exitCode: number,
		at: number,
	): boolean {
		const digest = createHash("sha256")
			.update(`${exitCode}\n${output}`, "utf8")
			.digest("hex");
		const seen = this.#db
			.select({ nodeId: conflictOutputs.nodeId })
			.from(conflictOutputs)
			.where(
				and(eq(conflictOutputs.nodeId, id), eq(conflictOutputs.digest, digest)),
			)
			.get();
		if (seen) return false;
		this.#db
			.insert(conflictOutputs)
			.values({ nodeId: id, digest, seenAt: at })
			.run();
		return true;
	}

	/** Points a node at a snapshot blob: the row only (callers update memory once committed). */
	#writeSnapshot(id: string, ref: SnapshotRef): void {
		this.#db
			.update(nodes)
			.set({
				snapshotDriver: ref.driver,
				snapshotKey: ref.key,
				snapshotBytes: ref.bytes,
			})
			.where(eq(nodes.id, id))
			.run();
	}

	/**
	 * Managed mode's snapshot of a state it executed, taken after the record
	 * (the host's upload awaits, and other requests run meanwhile). The node
	 * may have been evicted since, or given a snapshot by another record:
	 * then nothing changes (the first snapshot stands, so a lease on it
	 * still names its blob) and the new blob, which nothing points at, is
	 * left to the orphan sweep.
	 */
	#attachManaged(id: string, ref: SnapshotRef): AttachResult {
		const n = this.#index.get(id);
		if (n === undefined || n.kind !== "state") return "no_node";
		if (n.snapshot) return "has_snapshot";
		if (this.#deletedBlob(ref.key)) return "deleted";
		const at = now();
		this.ctx.storage.transactionSync(() => {
			this.#writeSnapshot(id, ref);
			this.#writeLastUsed(at);
		});
		n.snapshot = true;
		this.#usage.snapshots++;
		this.#usage.snapshotBytes += ref.bytes;
		this.#checkBudgets();
		this.#touch();
		return "attached";
	}

	/** The cron's idle check reads this after a restart has lost #lastUsedAt. */
	#writeLastUsed(at: number): void {
		this.#lastUsedAt = Math.max(this.#lastUsedAt, at);
		this.#setMeta("last_used_at", String(this.#lastUsedAt));
	}

	/**
	 * Hits and misses are counted in memory and written in one transaction
	 * by the next alarm (within INDEX_FLUSH_DELAY_MS), stats or graph read,
	 * or eviction, or once MAX_PENDING_COUNTS hits wait: a lookup or a batch
	 * of edge hits then writes nothing, so its answer does not wait for a
	 * commit, and a busy task commits its counters once an alarm. The hits
	 * of each node are written less often, in a round every NODE_HITS_WRITE_MS
	 * that alarms write NODE_HITS_WRITE_BATCH nodes at a time, but at once
	 * for a graph read or eviction, which read them: each is an update of
	 * the node's whole row, and with hits spread over thousands of nodes
	 * those updates took a tenth of the process's CPU. What a crash loses is
	 * at most those seconds of counters; no cached output depends on them.
	 */
	#countHit(tool: string, id: string, execMs: number): void {
		this.#pendingHits.push({ id, tool, execMs });
		if (this.#pendingHits.length >= MAX_PENDING_COUNTS)
			this.#flushCounts("none");
	}

	#countMiss(tool: string): void {
		this.#pendingMisses.set(tool, (this.#pendingMisses.get(tool) ?? 0) + 1);
	}

	/**
	 * Writes the counted hits and misses: one upsert per tool, and the hits
	 * of nodes. With `nodeHits` "all", every node's, in one statement; with
	 * "when due", a round of them once NODE_HITS_WRITE_MS have passed since
	 * the last round began, NODE_HITS_WRITE_BATCH nodes a call, first counted
	 * first written, until the nodes counted when it began are written; with
	 * "none", no node's.
	 */
	#flushCounts(nodeHits: "all" | "when due" | "none" = "all"): void {
		const hits = this.#pendingHits;
		const misses = this.#pendingMisses;
		this.#pendingHits = [];
		this.#pendingMisses = new Map();
		const at = now();
		const unwritten = this.#unwrittenNodeHits;
		const perTool = new Map<
			string,
			{ hits: number; savedMs: number; misses: number }
		>();
		const tool = (name: string) => {
			let t = perTool.get(name);
			if (!t) perTool.set(name, (t = { hits: 0, savedMs: 0, misses: 0 }));
			return t;
		};
		for (const h of hits) {
			// A node evicted since its hit is not counted.
			if (!this.#index.has(h.id)) continue;
			const u = unwritten.get(h.id);
			if (u) {
				u.n++;
				u.at = at;
			} else unwritten.set(h.id, { n: 1, at });
			const t = tool(h.tool);
			t.hits++;
			t.savedMs += h.execMs;
		}
		for (const [name, n] of misses) tool(name).misses += n;
		if (nodeHits === "all") {
			this.#nodeHitsWrittenAt = at;
		} else if (
			nodeHits === "when due" &&
			this.#nodeHitsRoundLeft === 0 &&
			unwritten.size > 0 &&
			at - this.#nodeHitsWrittenAt >= NODE_HITS_WRITE_MS
		) {
			this.#nodeHitsRoundLeft = unwritten.size;
			this.#nodeHitsWrittenAt = at;
		}
		const take =
			nodeHits === "all"
				? unwritten.size
				: nodeHits === "when due"
					? Math.min(this.#nodeHitsRoundLeft, NODE_HITS_WRITE_BATCH)
					: 0;
		if (perTool.size === 0 && take === 0) return;
		this.ctx.storage.transactionSync(() => {
			if (take > 0) {
				const counts: Record<string, [number, number]> = {};
				const taken: string[] = [];
				// A Map iterates in insertion order, and a count is updated in place:
				// the nodes first counted are first written.
				for (const [id, u] of unwritten) {
					if (taken.length === take) break;
					taken.push(id);
					// Evicted since it was counted: nothing to write.
					if (this.#index.has(id)) counts[id] = [u.n, u.at];
				}
				// The join parses the counts once and finds each node by its index.
				this.#db.run(
					sql`update ${nodes} set hits = hits + (c.value ->> 0), last_hit_at = (c.value ->> 1) from json_each(${JSON.stringify(counts)}) as c where ${nodes.id} = c.key`,
				);
				for (const id of taken) unwritten.delete(id);
				this.#nodeHitsRoundLeft =
					unwritten.size === 0 ? 0 : this.#nodeHitsRoundLeft - taken.length;
			}
			for (const [name, t] of perTool) {
				this.#bumpTool(name, {
					lookups: t.hits + t.misses,
					hits: t.hits,
					misses: t.misses,
					savedMs: t.savedMs,
				});
			}
		});
	}

	#bumpTool(
		tool: string,
		d: Partial<Omit<ToolStats, "nondeterministic">>,
	): void {
		const v: Record<string, string | number> = { tool };
		for (const k of TOOL_COUNTERS) v[k] = d[k] ?? 0;
		this.#q.bumpTool.run(v);
	}

	#grantLease(state: string, ttlMs: number, at: number): Lease {
		const id = crypto.randomUUID();
		const expiresAt = at + ttlMs;
		this.#db.insert(leases).values({ id, nodeId: state, expiresAt }).run();
		this.#writeLastUsed(at);
		this.#armAlarm(expiresAt);
		return { id, state, expiresAt };
	}

	#liveLease(id: string): Result<{ nodeId: string }> {
		const row = this.#db.select().from(leases).where(eq(leases.id, id)).get();
		if (!row) return fail(404, "lease_not_found", "no such lease");
		if (row.expiredAt !== null || row.expiresAt <= now()) {
			return fail(
				409,
				"lease_expired",
				"the lease expired; look up again for a new one",
			);
		}
		return ok({ nodeId: row.nodeId });
	}

	#armAlarm(at: number): void {
		if (this.#alarmAt !== null && this.#alarmAt <= at) return;
		this.#alarmAt = at;
		// Storage calls are ordered; there is nothing to wait for here.
		void this.ctx.storage.setAlarm(at);
	}

	/** Marks the task index stale; the alarm writes it to D1 shortly. */
	#touch(): void {
		this.#lastUsedAt = now();
		this.#indexSoon();
	}

	/** Has the next alarm write the task index. */
	#indexSoon(): void {
		this.#indexDirty = true;
		this.#armAlarm(now() + INDEX_FLUSH_DELAY_MS);
	}

	#remember(scope: Scope): void {
		if (this.#scopeOf() !== null) return;
		this.#db
			.insert(meta)
			.values([
				{ key: "project", value: scope.project },
				{ key: "task", value: scope.task },
				{ key: "created_at", value: String(now()) },
			])
			.onConflictDoNothing()
			.run();
		this.#scope = scope;
	}

	#scope: Scope | null = null;
	#scopeOf(): Scope | null {
		if (this.#scope) return this.#scope;
		const rows = this.#db.select().from(meta).all();
		const m = Object.fromEntries(rows.map((r) => [r.key, r.value]));
		if (m.project === undefined) return null;
		this.#scope = { project: m.project, task: m.task };
		return this.#scope;
	}

	async #flushIndex(at: number): Promise<void> {
		const scope = this.#scopeOf();
		if (scope === null) return;
		const s = await this.stats(scope);
		if (s === null) return;
		const created = Number(
			this.#db.select().from(meta).where(eq(meta.key, "created_at")).get()
				?.value ?? at,
		);
		// The cron's idle check reads this after a restart has lost #lastUsedAt.
		const lastUsed = String(this.#lastUsed() || at);
		this.#setMeta("last_used_at", lastUsed);
		// A change during the write below marks the index dirty again.
		this.#indexDirty = false;
		await this.env.DB.prepare(
			`insert into tasks (project_id, task, created_at, last_used_at, nodes, snapshots, bytes, lookups, hits)
			 values (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
			 on conflict (project_id, task) do update set
			   last_used_at = excluded.last_used_at, nodes = excluded.nodes,
			   snapshots = excluded.snapshots, bytes = excluded.bytes,
			   lookups = excluded.lookups, hits = excluded.hits`,
		)
			.bind(
				scope.project,
				scope.task,
				created,
				Number(lastUsed),
				s.nodes,
				s.snapshots,
				s.outputBytes + s.snapshotBytes,
				s.lookups,
				s.hits,
			)
			.run()
			.catch((e: unknown) => {
				this.#indexDirty = true;
				throw e;
			});
		// What the index has seen, for the start's check (#indexBehind).
		this.#setMeta("indexed_at", lastUsed);
	}

	/**
	 * Whether this task changed since the task index last took it in: it has
	 * a scope and was never indexed, or was used after. Only `meta` says so
	 * after a restart (a record writes `last_used_at` with its rows).
	 */
	#indexBehind(): boolean {
		const rows = this.#db.select().from(meta).all();
		const m = Object.fromEntries(rows.map((r) => [r.key, r.value]));
		if (m.project === undefined) return false;
		if (m.indexed_at === undefined) return true;
		return Number(m.last_used_at ?? 0) > Number(m.indexed_at);
	}

	#setMeta(key: string, value: string): void {
		this.#db
			.insert(meta)
			.values({ key, value })
			.onConflictDoUpdate({ target: meta.key, set: { value } })
			.run();
	}
}

/** A record's call was evicted between its blob pass and its transaction. */
class EvictedMeanwhile extends Error {}

/**
 * Ids bound in one statement (`id in (?, ...)`): SQLite in a Durable Object
 * takes at most 100 bound parameters a statement, and an update binds a few
 * values of its own.
 */
const SQL_IDS = 90;

function chunks<T>(items: T[], size: number): T[][] {
	const out: T[][] = [];
	for (let i = 0; i < items.length; i += size)
		out.push(items.slice(i, i + size));
	return out;
}
