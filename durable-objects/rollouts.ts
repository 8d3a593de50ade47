/**
 * Managed mode inside a task graph: rollouts send tool calls, and the task
 * graph answers hits from the tree and executes misses on container hosts.
 *
 * A miss goes through the planner (core/planner.ts), runs on a host, and is
 * recorded like any client's record. Identical misses in flight at once are
 * executed once (single-flight): the others wait and count as coalesced.
 * After a state-changing call the selective snapshot rule decides whether to
 * snapshot. A host that fails is marked down and the call moves to another,
 * from the last recorded state.
 */
import { eq, sql } from "drizzle-orm";
import type { DrizzleSqliteDODatabase } from "drizzle-orm/durable-sqlite";
import type { SnapshotRef } from "../core/api.ts";
import { sqlCallMutates } from "../core/classify.ts";
import { now } from "../core/clock.ts";
import type {
	ExecResponse,
	ForkResponse,
	SnapshotResponse,
	StartSandboxResponse,
	Template,
	WarmRequest,
} from "../core/host-api.ts";
import { ROOT_ID, callKey, childId, obsId } from "../core/ids.ts";
import type {
	OpenRolloutRequest,
	RolloutCallRequest,
	RolloutCallResponse,
	RolloutSummary,
} from "../core/managed-api.ts";
import { blend, decideSnapshot, plan, type Plan } from "../core/planner.ts";
import { fail, ok, type Result } from "../core/result.ts";
import { HostDown, HostRefused, HostSet, type Host } from "./hosts.ts";
import type * as schema from "./task-graph.schema.ts";
import { costs, rollouts } from "./task-graph.schema.ts";
import type { AttachResult, Scope, StoredHit } from "./task-graph.ts";

/** What the runner needs of its task graph. */
export interface GraphAccess {
	has(id: string): boolean;
	/** The recorded result, without counting it. */
	stored(id: string): { hit: StoredHit; tool: string } | null;
	output(hit: StoredHit): Promise<string>;
	countHit(tool: string, id: string, execMs: number): void;
	/** A snapshot was restored (or a warm fork of it taken). */
	countRestore(id: string): void;
	countMiss(tool: string): void;
	countCoalesced(tool: string): void;
	countOracle(tool: string, mismatch: boolean): void;
	/** The held states from the root (exclusive) down to `state`. */
	path(state: string): PathNode[];
	record(
		scope: Scope,
		from: string,
		calls: {
			tool: string;
			args: unknown;
			mutates: boolean;
			output: string;
			exitCode: number;
			execMs: number;
		}[],
	): Promise<Result<unknown>>;
	notePolicy(
		id: string,
		d: { replayMs: number; costMs: number; snapshot: boolean },
	): void;
	/**
	 * Points a state at a snapshot taken after its record; anything but
	 * `attached` means the node is gone or has a snapshot already, and the
	 * blob was left for the orphan sweep.
	 */
	attachSnapshot(id: string, ref: SnapshotRef): AttachResult;
}

export interface PathNode {
	id: string;
	tool: string;
	args: unknown;
	execMs: number;
	snapshot: SnapshotRef | null;
}

/** Priors until something is measured, as shares of SANDBOX_COST_PRIOR_MS. */
const PRIOR_SHARE: Record<string, number> = {
	start: 1,
	restore: 1,
	snapshot: 1,
	pool: 0.05,
};
const HOST_TIMEOUT_MS = 60_000;
const EXEC_TIMEOUT_MS = 120_000;
/** Hosts tried for one call before the rollout sees an error. */
const MAX_ATTEMPTS = 4;

type Row = typeof rollouts.$inferSelect;

interface Executed {
	output: string;
	exitCode: number;
	execMs: number;
	plan: RolloutCallResponse["plan"];
	/** Where it ran; the sandbox is now in the call's state. */
	hostId: string;
	sandboxId: string;
}

export class RolloutRunner {
	#inflight = new Map<string, Promise<Result<Executed>>>();
	/** Rollouts waiting on each in-flight call. */
	#waiters = new Map<string, number>();
	/** Forks of an executed sandbox, one per waiter, for them to take. */
	#forks = new Map<string, { hostId: string; sandboxId: string }[]>();
	#busy = new Set<string>();
	/** Warm pools this object asked hosts for: `root:<template>` or `state:<id>` → host. */
	#warm = new Map<string, string>();
	readonly hosts: HostSet;

	constructor(
		private readonly db: DrizzleSqliteDODatabase<typeof schema>,
		private readonly graph: GraphAccess,
		d1: D1Database,
		private readonly scope: () => Scope,
		private readonly options: {
			warmRoots: number;
			warmForks: number;
			/** What a sandbox start, restore or snapshot is assumed to cost before one is measured. */
			costPriorMs: number;
		},
	) {
		this.hosts = new HostSet(d1, () => this.scope().project);
	}

	/** Opens a rollout at the root; asks a host to keep warm roots for its template. */
	async open(req: OpenRolloutRequest): Promise<Result<RolloutSummary>> {
		const id = crypto.randomUUID();
		this.db
			.insert(rollouts)
			.values({
				id,
				template: JSON.stringify(req.template),
				state: ROOT_ID,
				oracle: req.oracle ?? false,
				createdAt: now(),
			})
			.run();
		// One warm-pool request per template per object: the host keeps refilling it.
		const warmKey = `root:${JSON.stringify(req.template)}`;
		if (this.options.warmRoots > 0 && !this.#warm.has(warmKey)) {
			await this.#warmRoot(req.template);
		}
		return ok(this.#summary(this.#row(id)!));
	}

	/** One tool call of a rollout: a hit, a coalesced hit, or an execution on a host. */
	async call(
		rolloutId: string,
		req: RolloutCallRequest,
	): Promise<Result<RolloutCallResponse>> {
		const r = this.#row(rolloutId);
		if (!r) return fail(404, "rollout_not_found", "no such rollout");
		if (r.closedAt !== null)
			return fail(409, "rollout_closed", "the rollout is closed");
		if (this.#busy.has(rolloutId)) {
			return fail(
				409,
				"rollout_busy",
				"the rollout's previous call has not finished",
			);
		}
		this.#busy.add(rolloutId);
		try {
			return await this.#call(r, req);
		} finally {
			this.#busy.delete(rolloutId);
		}
	}

	/** Stops the rollout's sandbox and closes it. */
	async close(rolloutId: string): Promise<Result<RolloutSummary>> {
		const r = this.#row(rolloutId);
		if (!r) return fail(404, "rollout_not_found", "no such rollout");
		if (r.closedAt === null) {
			await this.#stopSandbox(r);
			this.db
				.update(rollouts)
				.set({ closedAt: now() })
				.where(eq(rollouts.id, rolloutId))
				.run();
		}
		return ok(this.#summary(this.#row(rolloutId)!));
	}

	get(rolloutId: string): Result<RolloutSummary> {
		const r = this.#row(rolloutId);
		return r
			? ok(this.#summary(r))
			: fail(404, "rollout_not_found", "no such rollout");
	}

	// ------------------------------------------------------------ internals

	async #call(
		r: Row,
		req: RolloutCallRequest,
	): Promise<Result<RolloutCallResponse>> {
		const start = now();
		const template = JSON.parse(r.template) as Template;
		const call = { tool: req.tool, args: req.args ?? null };
		const mutates = req.mutates ?? defaultMutates(template, call);
		const key = callKey(call);
		const id = mutates ? childId(r.state, key) : obsId(r.state, key);
		const next = mutates ? id : r.state;

		let coalesced = false;
		let executed: Executed | null = null;
		if (!this.graph.has(id)) {
			const flight = this.#inflight.get(id);
			if (flight) {
				coalesced = true;
				this.#waiters.set(id, (this.#waiters.get(id) ?? 0) + 1);
				const res = await flight;
				if (!res.ok) return res;
				// Take a fork of the sandbox that ran it, if one was made for us:
				// our next miss then starts from our own live sandbox.
				const fork = this.#forks.get(id)?.pop();
				if (fork) {
					await this.#stopSandbox(r);
					this.#setSandbox(r.id, fork.hostId, fork.sandboxId, next);
				}
			} else {
				this.graph.countMiss(call.tool);
				const p = this.#execute(
					r,
					template,
					{ ...call, mutates },
					id,
					req.timeoutMs,
				).then(async (res) => {
					const waiting = this.#waiters.get(id) ?? 0;
					this.#waiters.delete(id);
					if (res.ok && mutates && waiting > 0) {
						this.#forks.set(id, await this.#forkFor(res.value, waiting));
					}
					return res;
				});
				this.#inflight.set(id, p);
				let res: Result<Executed>;
				try {
					res = await p;
				} finally {
					this.#inflight.delete(id);
				}
				if (!res.ok) return res;
				executed = res.value;
			}
		}

		const stored = this.graph.stored(id);
		if (!stored)
			return fail(
				503,
				"not_recorded",
				"the call ran but its record is missing",
			);
		const hit = executed === null;
		if (hit) {
			if (coalesced) this.graph.countCoalesced(call.tool);
			else this.graph.countHit(call.tool, id, stored.hit.execMs);
		}
		const output = executed?.output ?? (await this.graph.output(stored.hit));
		const exitCode = executed?.exitCode ?? stored.hit.exitCode;

		let oracle: RolloutCallResponse["oracle"];
		if (hit && r.oracle) {
			const check = await this.#oracle(
				r,
				template,
				{ ...call, mutates },
				output,
				exitCode,
			);
			if (!check.ok) return check;
			oracle = { match: check.value };
			this.graph.countOracle(call.tool, !check.value);
		}

		const savedMs = hit ? stored.hit.execMs : 0;
		this.db
			.update(rollouts)
			.set({
				state: next,
				calls: sql`${rollouts.calls} + 1`,
				hits: sql`${rollouts.hits} + ${hit && !coalesced ? 1 : 0}`,
				coalesced: sql`${rollouts.coalesced} + ${coalesced ? 1 : 0}`,
				misses: sql`${rollouts.misses} + ${hit ? 0 : 1}`,
				savedMs: sql`${rollouts.savedMs} + ${savedMs}`,
			})
			.where(eq(rollouts.id, r.id))
			.run();
		return ok({
			id,
			state: next,
			output,
			exitCode,
			hit,
			coalesced,
			execMs: stored.hit.execMs,
			savedMs,
			tookMs: now() - start,
			plan: executed?.plan ?? null,
			...(oracle ? { oracle } : {}),
		});
	}

	/**
	 * Executes a missed call: plan, get a sandbox on a host, replay, run,
	 * record; retried on another host when one fails.
	 */
	async #execute(
		r: Row,
		template: Template,
		call: { tool: string; args: unknown; mutates: boolean },
		id: string,
		timeoutMs: number | undefined,
	): Promise<Result<Executed>> {
		const path = this.graph.path(r.state);
		const exclude = new Set<string>();
		let row = r;
		for (let attempt = 0; attempt < MAX_ATTEMPTS; attempt++) {
			const liveDepth = this.#liveDepth(row, path, exclude);
			const p = plan({
				path: path.map((s) => ({
					id: s.id,
					execMs: s.execMs,
					snapshot: s.snapshot !== null,
					warm: this.#warm.has(`state:${s.id}`),
				})),
				liveDepth,
				warmRoot: this.#warm.has(`root:${row.template}`),
				costs: {
					startMs: this.#cost(template.driver, "start"),
					restoreMs: this.#cost(template.driver, "restore"),
					poolMs: this.#cost(template.driver, "pool"),
				},
			});
			const host =
				p.kind === "live"
					? await this.hosts.get(row.hostId!)
					: await this.hosts.pick(
							template.driver,
							exclude,
							this.#preferredHost(p, path, row.template),
						);
			if (!host) {
				if (p.kind === "live") {
					row = this.#forgetSandbox(row);
					continue;
				}
				return fail(
					503,
					"no_host",
					`no container host can run ${template.driver} sandboxes now`,
				);
			}
			try {
				return ok(
					await this.#run(row, host, template, p, path, call, id, timeoutMs),
				);
			} catch (err) {
				if (
					err instanceof HostDown ||
					(err instanceof HostRefused && err.status === 429)
				) {
					exclude.add(host.id);
					if (row.hostId === host.id) row = this.#forgetSandbox(row);
					continue;
				}
				if (err instanceof HostRefused) {
					return fail(
						400,
						"host_refused",
						`the host refused: ${err.code}: ${err.message}`,
					);
				}
				throw err;
			} finally {
				row = this.#row(r.id)!;
			}
		}
		return fail(503, "no_host", "every container host tried failed");
	}

	async #run(
		r: Row,
		host: Host,
		template: Template,
		p: Plan,
		path: PathNode[],
		call: { tool: string; args: unknown; mutates: boolean },
		id: string,
		timeoutMs: number | undefined,
	): Promise<Executed> {
		const scope = this.scope();
		let sandboxId: string;
		if (p.kind === "live") {
			sandboxId = r.sandboxId!;
		} else {
			await this.#stopSandbox(r);
			const base = p.from === 0 ? null : path[p.from - 1];
			const t0 = now();
			const started = await this.hosts.call<StartSandboxResponse>(
				host,
				"POST",
				"/sandboxes",
				{
					template,
					...(base
						? {
								restore: {
									task: scope.task,
									state: base.id,
									ref: base.snapshot!,
								},
							}
						: {}),
				},
				HOST_TIMEOUT_MS,
			);
			sandboxId = started.id;
			if (base) this.graph.countRestore(base.id);
			const kind =
				started.source === "pool"
					? "pool"
					: started.source === "restore"
						? "restore"
						: "start";
			this.#learn(template.driver, kind, started.startMs || now() - t0);
			this.#setSandbox(r.id, host.id, sandboxId, base?.id ?? ROOT_ID);
		}

		// Replay, then the call. Every executed call is recorded from where
		// the sandbox started; replayed ones come back `exists` (or `conflict`,
		// which flags a nondeterministic tool).
		const from = p.from === 0 ? ROOT_ID : path[p.from - 1].id;
		const executed: {
			tool: string;
			args: unknown;
			mutates: boolean;
			output: string;
			exitCode: number;
			execMs: number;
		}[] = [];
		const exec = (c: { tool: string; args: unknown; mutates?: boolean }) =>
			this.hosts.call<ExecResponse>(
				host,
				"POST",
				`/sandboxes/${sandboxId}/exec`,
				{ call: c, timeoutMs: timeoutMs ?? EXEC_TIMEOUT_MS },
				(timeoutMs ?? EXEC_TIMEOUT_MS) + HOST_TIMEOUT_MS,
			);
		for (const s of path.slice(p.from)) {
			const out = await exec({ tool: s.tool, args: s.args, mutates: true });
			executed.push({
				tool: s.tool,
				args: s.args,
				mutates: true,
				...pick(out),
			});
		}
		const out = await exec(call);
		executed.push({ ...call, ...pick(out) });

		const rec = await this.graph.record(scope, from, executed);
		if (!rec.ok)
			throw new Error(`recording an executed run failed: ${rec.code}`);
		this.#setSandbox(r.id, host.id, sandboxId, call.mutates ? id : r.state);

		if (call.mutates)
			await this.#maybeSnapshot(
				host,
				sandboxId,
				template,
				path,
				id,
				out.execMs,
			);
		return {
			output: out.output,
			exitCode: out.exitCode,
			execMs: out.execMs,
			plan: { kind: p.kind, from: p.from, replayed: path.length - p.from },
			hostId: host.id,
			sandboxId,
		};
	}

	/** The selective snapshot rule after a state-changing call, recorded on the node. */
	async #maybeSnapshot(
		host: Host,
		sandboxId: string,
		template: Template,
		path: PathNode[],
		id: string,
		execMs: number,
	): Promise<void> {
		let replayMs = execMs;
		for (let d = path.length - 1; d >= 0 && path[d].snapshot === null; d--)
			replayMs += path[d].execMs;
		const decision = decideSnapshot(
			replayMs,
			this.#cost(template.driver, "snapshot"),
			this.#cost(template.driver, "restore"),
		);
		this.graph.notePolicy(id, decision);
		if (!decision.snapshot) return;
		let snap: SnapshotResponse;
		try {
			snap = await this.hosts.call<SnapshotResponse>(
				host,
				"POST",
				`/sandboxes/${sandboxId}/snapshot`,
				{ task: this.scope().task, state: id },
				HOST_TIMEOUT_MS,
			);
		} catch (err) {
			// The call is recorded already; a snapshot refused (too large, past
			// the project's quota) only leaves the state without one.
			if (err instanceof HostRefused) {
				console.warn(`no snapshot of ${id}: ${err.code}: ${err.message}`);
				return;
			}
			throw err;
		}
		this.#learn(template.driver, "snapshot", snap.snapshotMs);
		const ref = { driver: snap.driver, key: snap.key, bytes: snap.bytes };
		// The upload awaited the host: the node may have been evicted, or have
		// been given another snapshot, meanwhile. Then this blob is no node's,
		// and nothing is warmed from it.
		if (this.graph.attachSnapshot(id, ref) !== "attached") return;
		if (this.options.warmForks > 0) {
			// Proactive forking: the next rollouts that miss below this state
			// take a ready copy instead of waiting for a restore.
			const warm: WarmRequest = {
				template,
				restore: { task: this.scope().task, state: id, ref },
				count: this.options.warmForks,
			};
			await this.hosts
				.call(host, "POST", "/pools/warm", warm, HOST_TIMEOUT_MS)
				.then(
					() => this.#warm.set(`state:${id}`, host.id),
					() => undefined,
				);
		}
	}

	/** Oracle: the call in a fresh sandbox after a full replay, compared with the cache. */
	async #oracle(
		r: Row,
		template: Template,
		call: { tool: string; args: unknown; mutates: boolean },
		output: string,
		exitCode: number,
	): Promise<Result<boolean>> {
		const path = this.graph.path(r.state);
		const exclude = new Set<string>();
		for (let attempt = 0; attempt < MAX_ATTEMPTS; attempt++) {
			const host = await this.hosts.pick(template.driver, exclude);
			if (!host) break;
			let sandboxId: string | null = null;
			try {
				const started = await this.hosts.call<StartSandboxResponse>(
					host,
					"POST",
					"/sandboxes",
					{ template },
					HOST_TIMEOUT_MS,
				);
				sandboxId = started.id;
				const exec = (c: { tool: string; args: unknown; mutates?: boolean }) =>
					this.hosts.call<ExecResponse>(
						host,
						"POST",
						`/sandboxes/${started.id}/exec`,
						{ call: c, timeoutMs: EXEC_TIMEOUT_MS },
						EXEC_TIMEOUT_MS + HOST_TIMEOUT_MS,
					);
				for (const s of path)
					await exec({ tool: s.tool, args: s.args, mutates: true });
				const out = await exec(call);
				return ok(out.output === output && out.exitCode === exitCode);
			} catch (err) {
				if (err instanceof HostDown) {
					exclude.add(host.id);
					continue;
				}
				throw err;
			} finally {
				if (sandboxId !== null) {
					await this.hosts
						.call(
							host,
							"DELETE",
							`/sandboxes/${sandboxId}`,
							undefined,
							HOST_TIMEOUT_MS,
						)
						.catch(() => undefined);
				}
			}
		}
		return fail(
			503,
			"no_host",
			"no container host could run the oracle's replay",
		);
	}

	/**
	 * Proactive forking for a GRPO group: the rollouts that waited on this
	 * call each get a copy of the sandbox that ran it. Best effort: a fork
	 * that fails just leaves a waiter without a sandbox.
	 */
	async #forkFor(
		e: Executed,
		count: number,
	): Promise<{ hostId: string; sandboxId: string }[]> {
		const host = await this.hosts.get(e.hostId);
		if (!host) return [];
		const forks: { hostId: string; sandboxId: string }[] = [];
		for (let i = 0; i < count; i++) {
			try {
				const f = await this.hosts.call<ForkResponse>(
					host,
					"POST",
					`/sandboxes/${e.sandboxId}/fork`,
					{},
					HOST_TIMEOUT_MS,
				);
				forks.push({ hostId: host.id, sandboxId: f.id });
			} catch {
				break;
			}
		}
		return forks;
	}

	async #warmRoot(template: Template): Promise<void> {
		const host = await this.hosts.pick(template.driver, new Set());
		if (!host) return;
		const warm: WarmRequest = { template, count: this.options.warmRoots };
		await this.hosts
			.call(host, "POST", "/pools/warm", warm, HOST_TIMEOUT_MS)
			.then(
				() => this.#warm.set(`root:${JSON.stringify(template)}`, host.id),
				() => undefined,
			);
	}

	#preferredHost(
		p: Plan,
		path: PathNode[],
		template: string,
	): string | undefined {
		if (p.kind === "warm")
			return this.#warm.get(`state:${path[p.from - 1].id}`);
		if (p.kind === "fresh") return this.#warm.get(`root:${template}`);
		return undefined;
	}

	/** Depth of the rollout's live sandbox on the path, if it has a usable one. */
	#liveDepth(
		r: Row,
		path: PathNode[],
		exclude: ReadonlySet<string>,
	): number | null {
		if (r.sandboxId === null || r.hostId === null || exclude.has(r.hostId))
			return null;
		if (r.sandboxState === ROOT_ID) return 0;
		const i = path.findIndex((s) => s.id === r.sandboxState);
		return i < 0 ? null : i + 1;
	}

	async #stopSandbox(r: Row): Promise<void> {
		if (r.sandboxId === null || r.hostId === null) return;
		const host = await this.hosts.get(r.hostId);
		this.#forgetSandbox(r);
		if (!host) return;
		// Best effort: a host that lost the sandbox, or is gone, frees it itself.
		await this.hosts
			.call(
				host,
				"DELETE",
				`/sandboxes/${r.sandboxId}`,
				undefined,
				HOST_TIMEOUT_MS,
			)
			.catch(() => undefined);
	}

	#forgetSandbox(r: Row): Row {
		this.db
			.update(rollouts)
			.set({ hostId: null, sandboxId: null, sandboxState: null })
			.where(eq(rollouts.id, r.id))
			.run();
		return { ...r, hostId: null, sandboxId: null, sandboxState: null };
	}

	#setSandbox(
		id: string,
		hostId: string,
		sandboxId: string,
		state: string,
	): void {
		this.db
			.update(rollouts)
			.set({ hostId, sandboxId, sandboxState: state })
			.where(eq(rollouts.id, id))
			.run();
	}

	#cost(driver: string, kind: string): number {
		const row = this.db
			.select()
			.from(costs)
			.where(eq(costs.key, `${driver}:${kind}`))
			.get();
		return row?.ms ?? this.#prior(kind);
	}

	#learn(driver: string, kind: string, ms: number): void {
		const key = `${driver}:${kind}`;
		const row = this.db.select().from(costs).where(eq(costs.key, key)).get();
		const samples = row?.samples ?? 0;
		const value = blend(row?.ms ?? this.#prior(kind), samples, ms);
		this.db
			.insert(costs)
			.values({ key, ms: value, samples: samples + 1 })
			.onConflictDoUpdate({
				target: costs.key,
				set: { ms: value, samples: samples + 1 },
			})
			.run();
	}

	#prior(kind: string): number {
		return this.options.costPriorMs * PRIOR_SHARE[kind];
	}

	#row(id: string): Row | undefined {
		return this.db.select().from(rollouts).where(eq(rollouts.id, id)).get();
	}

	#summary(r: Row): RolloutSummary {
		return {
			id: r.id,
			state: r.state,
			calls: r.calls,
			hits: r.hits,
			coalesced: r.coalesced,
			misses: r.misses,
			savedMs: r.savedMs,
			closed: r.closedAt !== null,
		};
	}
}

/**
 * Whether a call changes state when the trainer does not say: SQL that
 * certainly only reads is stateless; anything else is state-changing (a read
 * treated as a write costs hits, never correctness).
 */
function defaultMutates(
	template: Template,
	call: { tool: string; args: unknown },
): boolean {
	// The same rule the sqlite driver applies, so ids agree with the host.
	return template.driver === "sqlite" ? sqlCallMutates(call) : true;
}

function pick(out: ExecResponse): {
	output: string;
	exitCode: number;
	execMs: number;
} {
	return { output: out.output, exitCode: out.exitCode, execMs: out.execMs };
}
