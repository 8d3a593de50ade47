/**
 * The cached-execution loop of one rollout (library mode): ask the cache
 * first, run in a sandbox only what it does not know, and record what ran.
 */
import type {
	Lease,
	LookupResponse,
	Miss,
	RecordResponse,
	SnapshotRef,
} from "../core/api.ts";
import { ROOT_ID, callKey, childId, obsId, type Call } from "../core/ids.ts";
import {
	TrellisError,
	type LookupInput,
	type RecordInput,
	type TrellisClient,
} from "./http.ts";
import type {
	ExecResult,
	Sandbox,
	SandboxFactory,
	SnapshotSource,
} from "./sandbox.ts";

/** What the snapshot predicate is told about a state-changing call that just ran. */
export interface SnapshotInfo {
	call: Call;
	/** The state the call produced: the one the snapshot would hold. */
	state: string;
	/** State-changing calls from the root to `state`. */
	depth: number;
	execMs: number;
	/** The call was re-executed to rebuild state, not asked for by the agent. */
	replayed: boolean;
}

/** Options of a {@link CachedToolExecutor}. */
export interface ExecutorOptions {
	client: TrellisClient;
	/** The task every rollout of this executor belongs to. */
	task: string;
	/** Starts and restores the rollout's sandbox on a miss. */
	sandboxes: SandboxFactory;
	/**
	 * Snapshot after each state-changing call whose depth is a multiple of
	 * this, and upload it with the record. Off by default.
	 */
	snapshotEvery?: number;
	/** Snapshot after a state-changing call when this says so (with or instead of `snapshotEvery`). */
	snapshotWhen?: (info: SnapshotInfo) => boolean;
	/** Lease time-to-live asked for on a miss's snapshot (server default when absent). */
	leaseTtlMs?: number;
}

/** Options of one {@link CachedToolExecutor.call}. */
export interface CallOptions {
	/** Whether the call changes state; the sandbox factory decides when absent. */
	mutates?: boolean;
}

/** What {@link CachedToolExecutor.call} returns: the call's output and where it came from. */
export interface CallResult extends ExecResult {
	/** `hit`: from the cache, nothing ran; `miss`: executed in a sandbox. */
	status: "hit" | "miss";
	/** The result id: the state after a state-changing call, else the stateless result's id. */
	id: string;
	/** The rollout's state after the call. */
	state: string;
	/**
	 * A different output was recorded for this call first; the cache keeps
	 * that one, and `output` is what this sandbox really printed.
	 */
	conflict: boolean;
}

/** Per-rollout counters of a {@link CachedToolExecutor}. */
export interface RolloutCounters {
	/** Calls answered from the cache. */
	hits: number;
	/** Calls the cache did not know. */
	misses: number;
	/** Calls run in a sandbox: the misses plus the replays. */
	executed: number;
	/** State-changing calls re-run to rebuild a sandbox's state. */
	replayed: number;
	/** Execution time the hits saved, as recorded. */
	savedMs: number;
	/** Sandboxes restored from a snapshot. */
	restores: number;
	/** Snapshots taken and uploaded. */
	snapshots: number;
	/** Snapshots taken whose upload the cache refused (too large, over quota): the call stands without one. */
	snapshotsRefused: number;
	/**
	 * Snapshot leases the cache granted on misses; each is released before
	 * `call` returns (or, if that fails, left to expire: `unreleasedLeases`).
	 */
	leases: number;
	/** Leases whose release failed; each expires at its TTL instead. */
	unreleasedLeases: number;
	/** Recorded calls whose first recorded output differed from ours. */
	conflicts: number;
	/** Lookups whose cursor the graph no longer held (retried with the history). */
	staleCursors: number;
}

function counters(): RolloutCounters {
	return {
		hits: 0,
		misses: 0,
		executed: 0,
		replayed: 0,
		savedMs: 0,
		restores: 0,
		snapshots: 0,
		snapshotsRefused: 0,
		leases: 0,
		unreleasedLeases: 0,
		conflicts: 0,
		staleCursors: 0,
	};
}

/** A call with its defaults filled in, as ids and the wire see it. */
function normalize(
	tool: string,
	args: unknown,
	mutates: boolean,
): Required<Call> {
	return { tool, args: args === undefined ? null : args, mutates };
}

/**
 * Runs one rollout's tool calls through the cache.
 *
 * `call` looks the call up (by cursor when the graph is known to hold the
 * rollout's state, else by full history). A hit returns the recorded output
 * and touches no sandbox. A miss brings a sandbox to the rollout's state, by
 * whichever is shorter: the rollout's live sandbox plus the state-changing
 * calls it is behind by, or the miss's snapshot (or a fresh sandbox) plus
 * the miss's replay. It then runs the call and records everything it ran in
 * one record from where it started. Stateless calls never advance the state
 * and are never replayed.
 *
 * Calls of one executor run one at a time, in order; use one executor per
 * rollout (or {@link CachedToolExecutor.fork}) and `close()` it at the end.
 */
export class CachedToolExecutor {
	readonly task: string;
	readonly #client: TrellisClient;
	readonly #factory: SandboxFactory;
	readonly #options: ExecutorOptions;
	#history: Required<Call>[] = [];
	/** The state after each state-changing call: `#states[d]` is at depth d. */
	#states: string[] = [ROOT_ID];
	/** The state-changing calls of the history, in order. */
	#path: Required<Call>[] = [];
	/** The graph is known to hold the current state, so it can be a cursor. */
	#cursor = false;
	#sandbox: Sandbox | null = null;
	/** The depth of the live sandbox's state on the rollout's path. */
	#sandboxDepth = 0;
	#leases = new Set<string>();
	#queue: Promise<unknown> = Promise.resolve();
	#closed = false;
	#counters = counters();

	constructor(options: ExecutorOptions) {
		this.task = options.task;
		this.#client = options.client;
		this.#factory = options.sandboxes;
		this.#options = options;
	}

	/** A copy of this rollout's counters. */
	get counters(): RolloutCounters {
		return { ...this.#counters };
	}

	/** Every call of the rollout so far, with `args` and `mutates` filled in. */
	get history(): readonly Required<Call>[] {
		return [...this.#history];
	}

	/** The rollout's current state id. */
	get state(): string {
		return this.#states[this.#states.length - 1];
	}

	/** State-changing calls from the root to the current state. */
	get depth(): number {
		return this.#path.length;
	}

	/**
	 * Runs one tool call through the cache and returns its output.
	 *
	 * @param tool the tool's name, part of the cache key
	 * @param args any JSON value, part of the cache key (`null` when absent)
	 * @param options whether the call changes state, if the caller knows
	 * @throws whatever failed (the cache, the sandbox); the rollout is then
	 *   where it was before the call, so the call may simply be retried
	 */
	call(
		tool: string,
		args?: unknown,
		options: CallOptions = {},
	): Promise<CallResult> {
		return this.#enqueue(() => this.#call(tool, args, options));
	}

	/**
	 * A new rollout that continues from this one's current state, with fresh
	 * counters. A live sandbox is forked, so neither rollout disturbs the
	 * other's. It takes its turn with the calls: it forks the state after
	 * every call made before it, and none made after it.
	 */
	async fork(): Promise<CachedToolExecutor> {
		return this.#enqueue(() => this.#fork());
	}

	/**
	 * Runs `work` after everything queued before it, alone. Checked when
	 * queued: work queued before `close()` still runs.
	 */
	#enqueue<T>(work: () => Promise<T>): Promise<T> {
		this.#assertOpen();
		const run = this.#queue.then(work);
		this.#queue = run.catch(() => {});
		return run;
	}

	async #fork(): Promise<CachedToolExecutor> {
		const twin = new CachedToolExecutor(this.#options);
		twin.#history = [...this.#history];
		twin.#states = [...this.#states];
		twin.#path = [...this.#path];
		twin.#cursor = this.#cursor;
		if (this.#sandbox) {
			twin.#sandbox = await this.#sandbox.fork();
			twin.#sandboxDepth = this.#sandboxDepth;
		}
		return twin;
	}

	/** Stops the rollout's sandbox and releases any lease it holds. Idempotent. */
	async close(): Promise<void> {
		if (this.#closed) return;
		this.#closed = true;
		await this.#queue;
		await this.#dropSandbox();
		await Promise.all([...this.#leases].map((id) => this.#release(id)));
	}

	#assertOpen(): void {
		if (this.#closed) throw new Error("the executor is closed");
	}

	async #call(
		tool: string,
		args: unknown,
		options: CallOptions,
	): Promise<CallResult> {
		const probe = { tool, args: args === undefined ? null : args };
		const call = normalize(
			tool,
			args,
			options.mutates ?? this.#factory.mutates(probe),
		);
		const state = this.state;
		const key = callKey(call);
		const id = call.mutates ? childId(state, key) : obsId(state, key);

		const res = await this.#lookup(call);
		if (
			res.id !== id ||
			(res.status === "hit" && call.mutates && res.state !== id)
		)
			throw new Error(
				`the cache answered for result ${res.id}, the call's id is ${id}`,
			);
		let result: CallResult;
		if (res.status === "hit") {
			this.#counters.hits++;
			this.#counters.savedMs += res.execMs;
			result = {
				status: "hit",
				id,
				state: call.mutates ? id : state,
				output: res.output,
				exitCode: res.exitCode,
				execMs: res.execMs,
				conflict: false,
			};
		} else {
			this.#counters.misses++;
			result = await this.#miss(call, id, res);
		}
		this.#history.push(call);
		if (call.mutates) {
			this.#path.push(call);
			this.#states.push(id);
		}
		// A hit or a record leaves the state in the graph: from now on a
		// cursor is enough, and a lookup no longer carries the whole history.
		this.#cursor = true;
		return result;
	}

	async #lookup(call: Required<Call>): Promise<LookupResponse> {
		// A live sandbox already at the rollout's state needs no snapshot, so
		// the lookup does not pin one.
		const lease = !(this.#sandbox && this.#sandboxDepth === this.depth);
		const base = {
			call,
			lease,
			...(this.#options.leaseTtlMs !== undefined
				? { leaseTtlMs: this.#options.leaseTtlMs }
				: {}),
		};
		if (this.#cursor) {
			try {
				return await this.#client.lookup(this.task, {
					...base,
					cursor: this.state,
				} satisfies LookupInput);
			} catch (err) {
				// Eviction may drop the state the cursor names: say it in full.
				if (!(err instanceof TrellisError) || err.code !== "stale_cursor")
					throw err;
				this.#counters.staleCursors++;
				this.#cursor = false;
			}
		}
		return this.#client.lookup(this.task, {
			...base,
			history: this.#history,
		} satisfies LookupInput);
	}

	async #miss(
		call: Required<Call>,
		id: string,
		miss: Miss,
	): Promise<CallResult> {
		const stopRenewing = miss.lease ? this.#hold(miss.lease) : undefined;
		try {
			const fromDepth = await this.#bringUp(miss);
			const sandbox = this.#sandbox!;
			const recorded: RecordInput["calls"][number][] = [];
			// Only state-changing calls are replayed: a read at an earlier
			// state changed nothing, so re-running it would be wasted work.
			for (let d = fromDepth; d < this.depth; d++) {
				const step = this.#path[d];
				const out = await this.#exec(sandbox, step);
				this.#counters.replayed++;
				this.#sandboxDepth = d + 1;
				recorded.push({
					...step,
					...out,
					...(await this.#maybeSnapshot(step, d + 1, out, true)),
				});
			}
			const out = await this.#exec(sandbox, call);
			let res: RecordResponse;
			try {
				recorded.push({
					...call,
					...out,
					...(call.mutates
						? await this.#maybeSnapshot(call, this.depth + 1, out, false, id)
						: {}),
				});
				res = await this.#client.record(this.task, {
					from: this.#states[fromDepth],
					calls: recorded,
				});
			} catch (err) {
				// The call fails, so the rollout's history does not take it, but
				// the sandbox ran it: kept, it would be a state ahead, and the
				// call, retried, would run on top of itself. Drop it; the next
				// miss rebuilds the state from a snapshot or the root. (The
				// replays before the call are on the path: they leave the
				// sandbox consistent, and a read changes nothing.)
				if (call.mutates) await this.#dropSandbox(true);
				throw err;
			}
			if (call.mutates) this.#sandboxDepth = this.depth + 1;
			this.#counters.conflicts += res.conflicts;
			const last = res.results[res.results.length - 1];
			return {
				status: "miss",
				id,
				state: call.mutates ? id : this.state,
				...out,
				conflict: last?.status === "conflict",
			};
		} finally {
			stopRenewing?.();
			if (miss.lease) await this.#release(miss.lease.id);
		}
	}

	/**
	 * Makes the live sandbox hold a state on the rollout's path, from which
	 * the path's remaining state-changing calls are then replayed, and
	 * returns that state's depth.
	 */
	async #bringUp(miss: Miss): Promise<number> {
		const target = this.depth;
		let snapshot = miss.snapshot;
		// Trust the snapshot only if it lies on our own path: a cache that
		// answered for another path must not corrupt the rollout.
		if (
			snapshot &&
			(snapshot.driver !== this.#factory.driver ||
				snapshot.depth > target ||
				this.#states[snapshot.depth] !== snapshot.state)
		)
			snapshot = null;
		const fromServer = snapshot ? snapshot.depth : 0;
		if (this.#sandbox && target - this.#sandboxDepth <= target - fromServer)
			return this.#sandboxDepth;
		await this.#dropSandbox();
		if (snapshot) {
			const source: SnapshotSource = {
				ref: {
					driver: snapshot.driver,
					key: snapshot.key,
					bytes: snapshot.bytes,
				},
				read: () => this.#client.getSnapshot(this.task, snapshot.state),
			};
			try {
				this.#sandbox = await this.#factory.restore(source);
				this.#sandboxDepth = snapshot.depth;
				this.#counters.restores++;
				return snapshot.depth;
			} catch (err) {
				// A snapshot that cannot be restored (its blob swept, a driver
				// error) only costs time: rebuild from the root instead.
				if (err instanceof TrellisError && err.status === 401) throw err;
			}
		}
		this.#sandbox = await this.#factory.start();
		this.#sandboxDepth = 0;
		return 0;
	}

	async #exec(sandbox: Sandbox, call: Required<Call>): Promise<ExecResult> {
		try {
			const { output, exitCode, execMs } = await sandbox.exec(call);
			this.#counters.executed++;
			// Only these go on the wire: a driver's extra fields (a workspace's
			// `timedOut`, say) are not part of a record, which refuses them.
			return { output, exitCode, execMs };
		} catch (err) {
			// The sandbox's state is unknown after a failed exec: drop it.
			await this.#dropSandbox(true);
			throw err;
		}
	}

	async #maybeSnapshot(
		call: Required<Call>,
		depth: number,
		out: ExecResult,
		replayed: boolean,
		state: string = this.#stateAt(depth),
	): Promise<{ snapshot?: SnapshotRef }> {
		const every = this.#options.snapshotEvery;
		const info: SnapshotInfo = {
			call,
			state,
			depth,
			execMs: out.execMs,
			replayed,
		};
		const wanted =
			(every !== undefined && every > 0 && depth % every === 0) ||
			(this.#options.snapshotWhen?.(info) ?? false);
		if (!wanted || !this.#sandbox) return {};
		const snap = await this.#sandbox.snapshot();
		let ref: SnapshotRef;
		try {
			ref = await this.#client.putSnapshot(
				this.task,
				state,
				snap.data,
				snap.driver,
			);
		} catch (err) {
			// Refused for its size or the project's quota: the call stands
			// without a snapshot (a later miss replays instead of restoring).
			if (
				err instanceof TrellisError &&
				(err.status === 413 || err.code === "quota_exceeded")
			) {
				this.#counters.snapshotsRefused++;
				return {};
			}
			throw err;
		}
		this.#counters.snapshots++;
		return { snapshot: ref };
	}

	#stateAt(depth: number): string {
		return this.#states[depth];
	}

	/**
	 * Keeps a lease alive while a restore and replay may outlast it: renewed
	 * at half its life for the TTL it was asked for (without one, a renewal
	 * gets the server's default, shorter than the interval may be). The
	 * interval follows the TTL granted, which the server may have capped.
	 */
	#hold(lease: Lease): () => void {
		this.#counters.leases++;
		this.#leases.add(lease.id);
		const ttl = Math.max(lease.expiresAt - Date.now(), 1000);
		const timer = setInterval(() => {
			this.#client
				.renewLease(this.task, lease.id, this.#options.leaseTtlMs)
				.catch(() => {});
		}, ttl / 2);
		timer.unref?.();
		return () => clearInterval(timer);
	}

	/**
	 * Releases a lease; never throws. A lease that could not be released
	 * expires at its TTL, so a failure only keeps one snapshot from eviction
	 * a little longer: it must not fail a call that succeeded, or replace a
	 * failed call's own error. It is counted in `unreleasedLeases`.
	 */
	async #release(id: string): Promise<void> {
		this.#leases.delete(id);
		try {
			await this.#client.releaseLease(this.task, id);
		} catch (err) {
			// An expired or forgotten lease is as good as released.
			const gone =
				err instanceof TrellisError &&
				(err.code === "lease_expired" || err.code === "lease_not_found");
			if (!gone) this.#counters.unreleasedLeases++;
		}
	}

	/**
	 * Stops the live sandbox. Dropped because something failed, a sandbox
	 * that fails to stop as well must not hide that failure's error.
	 */
	async #dropSandbox(afterFailure = false): Promise<void> {
		const sandbox = this.#sandbox;
		this.#sandbox = null;
		this.#sandboxDepth = 0;
		if (!afterFailure) await sandbox?.stop();
		else await sandbox?.stop().catch(() => {});
	}
}
