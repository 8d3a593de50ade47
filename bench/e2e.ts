/**
 * The end-to-end benchmark (`npm run bench:e2e`): tool-call time of real
 * GRPO-like workloads without and with Trellis, on this machine.
 *
 * For each workload of `bench/workloads.ts` (terminal-like, SQL, RPC-like):
 *
 * 1. Without Trellis: every call of every rollout executed directly in a
 *    sandbox of the same driver the container host uses (loaded in this
 *    process through `host/registry.ts`), one sandbox per rollout, the
 *    rollouts of a group at once. A call's time is its wall time around the
 *    driver's exec; the rollout's first call also waits for its sandbox to
 *    start, as a miss with Trellis does (start latencies are also reported
 *    apart).
 * 2. With Trellis: the same calls, in the same groups and order, as managed
 *    rollouts through the Worker (`wrangler dev`) to a container host on
 *    loopback, from an empty cache (fresh task names). A call's time is the
 *    HTTP round trip the trainer waits, hits, coalesced hits, misses, sandbox
 *    starts, restores and replays included.
 * 3. Snapshot and restore costs: the snapshots the task graph chose to take
 *    (count, bytes, its learned snapshot + restore estimate, from the graph
 *    export and stats), the host's start latencies by source (fresh,
 *    restore, warm pool, fork), and one direct snapshot + restore of a
 *    baseline sandbox at the end of a rollout.
 *
 * Each workload gets its own project, keys and host, so hosts and their
 * latencies do not mix. Prints a markdown table to stdout and writes
 * `bench/results/e2e.json` (`e2e-quick.json` with --quick).
 *
 * Flags: --quick (a smoke run) --workloads terminal,sql,rpc --seed N
 *        --tasks N --group N --epochs N --driver docker|workspace (terminal)
 *        --oracle (check every hit by full replay) --out FILE --verbose
 *        --var NAME=VALUE (a Worker variable for the run, e.g.
 *        SANDBOX_COST_PRIOR_MS=100; repeatable)
 *        --snapshot (run the Worker from a frozen copy of the working tree's
 *        files as they are at the start: wrangler dev restarts the Worker
 *        whenever a source changes, which in a tree someone is editing
 *        lands mid-run)
 */
import { execFileSync, spawn } from "node:child_process";
import {
	mkdirSync,
	mkdtempSync,
	rmSync,
	symlinkSync,
	writeFileSync,
} from "node:fs";
import { cpus, loadavg, tmpdir, totalmem } from "node:os";
import path from "node:path";
import { performance } from "node:perf_hooks";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import { TrellisClient } from "../client/http.ts";
import type { Sandbox } from "../client/sandbox.ts";
import type { GraphNode, TaskStats } from "../core/api.ts";
import type { Driver } from "../core/host-api.ts";
import { loadDrivers, type HostDriver } from "../host/registry.ts";
import type { Host } from "../host/server.ts";
import {
	dockerStatus,
	REPO_ROOT,
	startLocalHost,
	startLocalStack,
	type LocalStack,
} from "../bin/local-stack.ts";
import {
	callCount,
	progress,
	quantile,
	runManaged,
	runTask,
	workload,
	type ManagedCall,
	type Workload,
	type WorkloadKind,
	type WorkloadOptions,
} from "./workloads.ts";

// ---------------------------------------------------------------- options

const { values } = parseArgs({
	options: {
		quick: { type: "boolean", default: false },
		workloads: { type: "string", default: "terminal,sql,rpc" },
		seed: { type: "string", default: "1" },
		tasks: { type: "string" },
		group: { type: "string" },
		epochs: { type: "string" },
		driver: { type: "string" },
		oracle: { type: "boolean", default: false },
		out: { type: "string" },
		verbose: { type: "boolean", default: false },
		snapshot: { type: "boolean", default: false },
		var: { type: "string", multiple: true },
		// Internal: this file run as the container host's own process.
		"child-host": { type: "string" },
	},
});

const QUICK = values.quick;
const KINDS = values.workloads
	.split(",")
	.map((k) => k.trim()) as WorkloadKind[];
for (const k of KINDS)
	if (!["terminal", "sql", "rpc"].includes(k))
		throw new Error(`--workloads: unknown workload ${k}`);

function int(name: string, v: string | undefined): number | undefined {
	if (v === undefined) return undefined;
	const n = Number(v);
	if (!Number.isSafeInteger(n) || n < 1)
		throw new Error(`--${name}: give a positive integer`);
	return n;
}

/**
 * Sizes per workload: a full run fits in about five minutes on a 2-core
 * machine; --quick is a smoke run of a few groups.
 */
const SIZES: Record<
	WorkloadKind,
	{ tasks: number; group: number; epochs: number }
> = QUICK
	? {
			terminal: { tasks: 1, group: 4, epochs: 2 },
			sql: { tasks: 1, group: 4, epochs: 2 },
			rpc: { tasks: 1, group: 4, epochs: 2 },
		}
	: {
			terminal: { tasks: 3, group: 8, epochs: 3 },
			sql: { tasks: 4, group: 8, epochs: 3 },
			rpc: { tasks: 3, group: 8, epochs: 3 },
		};

const OUT =
	values.out ??
	path.join(
		REPO_ROOT,
		"bench",
		"results",
		QUICK ? "e2e-quick.json" : "e2e.json",
	);

/** Worker variables given with --var, passed to the local stack. */
const VARS: Record<string, string> = {};
for (const v of values.var ?? []) {
	const at = v.indexOf("=");
	if (at <= 0) throw new Error(`--var: give NAME=VALUE, got ${v}`);
	VARS[v.slice(0, at)] = v.slice(at + 1);
}

const log = (m: string) => process.stderr.write(`${m}\n`);
const round = (x: number, digits = 1) => Number(x.toFixed(digits));

// --------------------------------------------------------------- baseline

/** One call run directly in a sandbox. */
interface DirectCall {
	epoch: number;
	ms: number;
	exitCode: number;
}

/** What running a workload without Trellis gave. */
interface DirectRun {
	calls: DirectCall[];
	/** Sandbox starts, one per rollout (counted in its first call). */
	startMs: number[];
	wallMs: number;
	/** One snapshot and restore of a sandbox at the end of a rollout. */
	snapshot: { ms: number; bytes: number; restoreMs: number } | null;
}

/**
 * Runs every call directly, a sandbox per rollout, a group's rollouts at
 * once. The last group's first rollout is snapshotted and restored once
 * before it stops, for the driver's direct snapshot and restore costs.
 */
async function runDirect(
	driver: HostDriver,
	w: Workload,
	tick: () => void,
): Promise<DirectRun> {
	const factory = driver.factory(w.template);
	const limits = { timeoutMs: 120_000, maxOutputBytes: 1 << 20 };
	const calls: DirectCall[] = [];
	const startMs: number[] = [];
	let snapshot: DirectRun["snapshot"] = null;
	const t0 = performance.now();
	for (const [gi, g] of w.groups.entries()) {
		await Promise.all(
			g.rollouts.map(async (rollout, r) => {
				// The sandbox starts when the first call needs it, and that call
				// waits for it: the same accounting as a miss with Trellis,
				// whose time includes getting its sandbox.
				const s0 = performance.now();
				const sandbox: Sandbox = await factory.start();
				const started = performance.now() - s0;
				startMs.push(started);
				try {
					for (const [i, call] of rollout.entries()) {
						const c0 = performance.now();
						const res = await driver.exec(sandbox, call, limits);
						calls.push({
							epoch: g.epoch,
							ms: performance.now() - c0 + (i === 0 ? started : 0),
							exitCode: res.exitCode,
						});
						tick();
					}
					if (gi === w.groups.length - 1 && r === 0) {
						const p0 = performance.now();
						const snap = await sandbox.snapshot();
						const ms = performance.now() - p0;
						const bytes = snap.data.byteLength;
						const r0 = performance.now();
						const copy = await factory.restore({
							ref: { driver: snap.driver, key: "snapshots/direct", bytes },
							read: async () => snap.data,
						});
						const restoreMs = performance.now() - r0;
						await copy.stop();
						snapshot = { ms, bytes, restoreMs };
					}
				} finally {
					await sandbox.stop();
				}
			}),
		);
	}
	return { calls, startMs, wallMs: performance.now() - t0, snapshot };
}

// ---------------------------------------------------------------- trellis

/** Every node of a task's graph, page by page. */
async function graphNodes(
	client: TrellisClient,
	task: string,
): Promise<GraphNode[]> {
	const nodes: GraphNode[] = [];
	let after: number | undefined;
	// Bounded: a run's graphs hold a few thousand nodes at most.
	for (let page = 0; page < 1000; page++) {
		const p = await client.graph(task, { after, limit: 1000 });
		nodes.push(...p.nodes);
		if (p.next === null) break;
		after = p.next;
	}
	return nodes;
}

/** What a workload's managed run left in its task graphs. */
interface GraphFigures {
	nodes: number;
	snapshots: number;
	snapshotBytes: number;
	/** Selective snapshot decisions: taken, and declined. */
	decisions: { taken: number; declined: number };
	/** The task graph's snapshot + restore estimate at its last decision (ms). */
	costEstimateMs: number | null;
	oracle: { checks: number; mismatches: number };
}

async function graphFigures(
	client: TrellisClient,
	tasks: string[],
): Promise<GraphFigures> {
	const f: GraphFigures = {
		nodes: 0,
		snapshots: 0,
		snapshotBytes: 0,
		decisions: { taken: 0, declined: 0 },
		costEstimateMs: null,
		oracle: { checks: 0, mismatches: 0 },
	};
	let lastDecision = -1;
	for (const task of tasks) {
		const stats: TaskStats = await client.stats(task);
		f.nodes += stats.nodes;
		f.snapshots += stats.snapshots;
		f.snapshotBytes += stats.snapshotBytes;
		f.oracle.checks += stats.oracle.checks;
		f.oracle.mismatches += stats.oracle.mismatches;
		for (const n of await graphNodes(client, task)) {
			if (!n.policy) continue;
			if (n.policy.snapshot) f.decisions.taken++;
			else f.decisions.declined++;
			if (n.createdAt >= lastDecision) {
				lastDecision = n.createdAt;
				f.costEstimateMs = round(n.policy.costMs);
			}
		}
	}
	return f;
}

// ---------------------------------------------------------------- figures

interface Side {
	medianMs: number;
	p95Ms: number;
	meanMs: number;
	totalMs: number;
}

function side(ms: number[]): Side {
	return {
		medianMs: round(quantile(ms, 0.5)),
		p95Ms: round(quantile(ms, 0.95)),
		meanMs: round(ms.reduce((s, x) => s + x, 0) / Math.max(1, ms.length)),
		totalMs: round(
			ms.reduce((s, x) => s + x, 0),
			0,
		),
	};
}

/** One workload's result, as written to e2e.json. */
interface WorkloadResult {
	kind: WorkloadKind;
	title: string;
	template: Workload["template"];
	standIns: string;
	size: { tasks: number; group: number; epochs: number; calls: number };
	hitRate: number;
	hitRateByEpoch: Record<string, number>;
	hits: number;
	coalesced: number;
	misses: number;
	without: Side & {
		wallMs: number;
		sandboxStartP50Ms: number;
		nonzeroExits: number;
	};
	with: Side & {
		wallMs: number;
		/** The server's own time per call (tookMs): the median and p95. */
		serverMedianMs: number;
		serverP95Ms: number;
		/** The median round trip of hits only, coalesced ones aside. */
		hitMedianMs: number;
	};
	speedup: { median: number; p95: number; total: number };
	/** Per epoch: the hit rate, the median call without and with, their ratio. */
	byEpoch: Record<
		string,
		{
			hitRate: number;
			withoutMedianMs: number;
			withMedianMs: number;
			speedup: number;
		}
	>;
	/** The calls with Trellis by what answered them (round trips). */
	byOutcome: Record<
		"hit" | "coalesced" | "miss",
		{ count: number; medianMs: number; p95Ms: number; totalMs: number }
	>;
	plans: Record<string, number>;
	replayedCalls: number;
	snapshots: GraphFigures & {
		direct: DirectRun["snapshot"];
		hostStarts: Record<string, { count: number; p50Ms: number }>;
		poolHits: number;
		poolMisses: number;
	};
}

function summarize(
	w: Workload,
	size: { tasks: number; group: number; epochs: number },
	direct: DirectRun,
	managed: ManagedCall[],
	wallMs: number,
	graph: GraphFigures,
	host: Health,
): WorkloadResult {
	const hits = managed.filter((c) => c.hit && !c.coalesced).length;
	const coalesced = managed.filter((c) => c.coalesced).length;
	const hitRateByEpoch: Record<string, number> = {};
	const byEpoch: WorkloadResult["byEpoch"] = {};
	for (const e of new Set(managed.map((c) => c.epoch))) {
		const calls = managed.filter((c) => c.epoch === e);
		const hitRate = round(calls.filter((c) => c.hit).length / calls.length, 3);
		hitRateByEpoch[e] = hitRate;
		const before = direct.calls.filter((c) => c.epoch === e).map((c) => c.ms);
		const w = quantile(before, 0.5);
		const t = quantile(
			calls.map((c) => c.wallMs),
			0.5,
		);
		byEpoch[e] = {
			hitRate,
			withoutMedianMs: round(w),
			withMedianMs: round(t),
			speedup: round(w / t, 2),
		};
	}
	const outcome = (pick: (c: ManagedCall) => boolean) => {
		const ms = managed.filter(pick).map((c) => c.wallMs);
		const s = side(ms);
		return {
			count: ms.length,
			medianMs: s.medianMs,
			p95Ms: s.p95Ms,
			totalMs: s.totalMs,
		};
	};
	const without = side(direct.calls.map((c) => c.ms));
	const withSide = side(managed.map((c) => c.wallMs));
	const plans: Record<string, number> = {};
	let replayedCalls = 0;
	for (const c of managed)
		if (c.plan) {
			plans[c.plan.kind] = (plans[c.plan.kind] ?? 0) + 1;
			replayedCalls += c.plan.replayed;
		}
	return {
		kind: w.kind,
		title: w.title,
		template: w.template,
		standIns: w.standIns,
		size: { ...size, calls: managed.length },
		hitRate: round((hits + coalesced) / managed.length, 3),
		hitRateByEpoch,
		hits,
		coalesced,
		misses: managed.length - hits - coalesced,
		without: {
			...without,
			wallMs: round(direct.wallMs, 0),
			sandboxStartP50Ms: round(quantile(direct.startMs, 0.5)),
			nonzeroExits: direct.calls.filter((c) => c.exitCode !== 0).length,
		},
		with: {
			...withSide,
			wallMs: round(wallMs, 0),
			serverMedianMs: round(
				quantile(
					managed.map((c) => c.tookMs),
					0.5,
				),
			),
			serverP95Ms: round(
				quantile(
					managed.map((c) => c.tookMs),
					0.95,
				),
			),
			hitMedianMs: round(
				quantile(
					managed.filter((c) => c.hit && !c.coalesced).map((c) => c.wallMs),
					0.5,
				),
			),
		},
		speedup: {
			median: round(without.medianMs / withSide.medianMs, 2),
			p95: round(without.p95Ms / withSide.p95Ms, 2),
			total: round(without.totalMs / withSide.totalMs, 2),
		},
		byEpoch,
		byOutcome: {
			hit: outcome((c) => c.hit && !c.coalesced),
			coalesced: outcome((c) => c.coalesced),
			miss: outcome((c) => !c.hit),
		},
		plans,
		replayedCalls,
		snapshots: {
			...graph,
			direct: direct.snapshot,
			hostStarts: host.starts,
			poolHits: host.poolHits,
			poolMisses: host.poolMisses,
		},
	};
}

const pct = (x: number) => `${(x * 100).toFixed(1)}%`;
const msf = (x: number) =>
	x >= 100 ? `${x.toFixed(0)} ms` : `${x.toFixed(1)} ms`;
const kb = (b: number) =>
	b >= 1 << 20
		? `${(b / (1 << 20)).toFixed(1)} MiB`
		: `${(b / 1024).toFixed(1)} KiB`;

/** The results as markdown tables. */
function markdown(results: WorkloadResult[]): string {
	const lines = [
		"| workload | calls | hit rate (by epoch) | coalesced | median without | median with | speedup (median) | p95 without | p95 with | speedup (p95) | total tool time without → with |",
		"|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
	];
	for (const r of results) {
		const epochs = Object.values(r.hitRateByEpoch).map(pct).join(" → ");
		lines.push(
			`| ${r.kind} (${r.template.driver}) | ${r.size.calls} | ${pct(r.hitRate)} (${epochs}) | ${r.coalesced} | ${msf(r.without.medianMs)} | ${msf(r.with.medianMs)} | **${r.speedup.median.toFixed(1)}×** | ${msf(r.without.p95Ms)} | ${msf(r.with.p95Ms)} | ${r.speedup.p95.toFixed(1)}× | ${(r.without.totalMs / 1000).toFixed(1)} s → ${(r.with.totalMs / 1000).toFixed(1)} s (${r.speedup.total.toFixed(1)}×) |`,
		);
	}
	lines.push(
		"",
		"| workload | per epoch: hit rate, median without → with (speedup) | hits: n, median, p95 | coalesced: n, median, p95 | misses: n, median, p95 |",
		"|---|---|---|---|---|",
	);
	for (const r of results) {
		const epochs = Object.entries(r.byEpoch)
			.map(
				([e, v]) =>
					`${e}: ${pct(v.hitRate)}, ${msf(v.withoutMedianMs)} → ${msf(v.withMedianMs)} (${v.speedup.toFixed(1)}×)`,
			)
			.join("<br>");
		const o = (k: keyof WorkloadResult["byOutcome"]) => {
			const v = r.byOutcome[k];
			return v.count === 0
				? "0"
				: `${v.count}, ${msf(v.medianMs)}, ${msf(v.p95Ms)}`;
		};
		lines.push(
			`| ${r.kind} | ${epochs} | ${o("hit")} | ${o("coalesced")} | ${o("miss")} |`,
		);
	}
	lines.push(
		"",
		"| workload | snapshots taken / declined | snapshot bytes | graph's snapshot+restore estimate | direct snapshot / restore | host starts (p50) | misses by plan | replayed calls |",
		"|---|---|---:|---:|---|---|---|---:|",
	);
	for (const r of results) {
		const s = r.snapshots;
		const starts = Object.entries(s.hostStarts)
			.map(([k, v]) => `${k} ${v.count}× ${msf(v.p50Ms)}`)
			.join(", ");
		const plans = Object.entries(r.plans)
			.map(([k, v]) => `${k} ${v}`)
			.join(", ");
		const direct = s.direct
			? `${msf(s.direct.ms)} / ${Number.isNaN(s.direct.restoreMs) ? "n/a" : msf(s.direct.restoreMs)} (${kb(s.direct.bytes)})`
			: "n/a";
		lines.push(
			`| ${r.kind} | ${s.snapshots} / ${s.decisions.declined} | ${kb(s.snapshotBytes)} | ${s.costEstimateMs === null ? "n/a" : msf(s.costEstimateMs)} | ${direct} | ${starts || "none"} | ${plans || "none"} | ${r.replayedCalls} |`,
		);
	}
	return lines.join("\n");
}

/** The commit the run was made at, `+dirty` when the tree had changes. */
function gitHead(): string | null {
	try {
		const head = execFileSync("git", ["rev-parse", "--short", "HEAD"], {
			cwd: REPO_ROOT,
			encoding: "utf8",
		}).trim();
		const dirty = execFileSync("git", ["status", "--porcelain", "-uno"], {
			cwd: REPO_ROOT,
			encoding: "utf8",
		}).trim();
		return dirty === "" ? head : `${head}+dirty`;
	} catch {
		return null;
	}
}

// ------------------------------------------------------------ child host

type Health = ReturnType<Host["health"]>;
type ChildMessage =
	| { ready: { url: string; id: string } }
	| { health: Health }
	| { error: string };

/**
 * Starts the container host in its own process, as it runs in a real
 * deployment: its work (docker streams, snapshots, JSON) then does not
 * delay the trainer's requests in this process's event loop. It answers
 * `health` over IPC.
 */
async function spawnHost(o: {
	worker: string;
	key: string;
	drivers: Driver[];
	name: string;
}): Promise<{ health(): Promise<Health>; stop(): Promise<void> }> {
	const child = spawn(
		path.join(REPO_ROOT, "node_modules", ".bin", "tsx"),
		[fileURLToPath(import.meta.url), "--child-host", JSON.stringify(o)],
		{ stdio: ["ignore", "inherit", "inherit", "ipc"] },
	);
	const next = (ms: number) =>
		new Promise<ChildMessage>((resolve, reject) => {
			const timer = setTimeout(
				() => reject(new Error("the host process did not answer")),
				ms,
			);
			child.once("message", (m) => {
				clearTimeout(timer);
				resolve(m as ChildMessage);
			});
			child.once("exit", (code) =>
				reject(new Error(`the host process exited (${code})`)),
			);
		});
	const exited = new Promise<void>((resolve) =>
		child.once("exit", () => resolve()),
	);
	const kill = () => {
		if (child.exitCode === null && child.signalCode === null)
			child.kill("SIGKILL");
	};
	try {
		const first = await next(60_000);
		if ("error" in first) throw new Error(`host: ${first.error}`);
	} catch (err) {
		kill();
		throw err;
	}
	return {
		async health() {
			child.send("health");
			const m = await next(10_000);
			if (!("health" in m)) throw new Error("host: no health");
			return m.health;
		},
		async stop() {
			child.send("stop");
			// Bounded: a host that does not stop in time is killed.
			const timer = setTimeout(kill, 30_000);
			await exited;
			clearTimeout(timer);
		},
	};
}

/** The child side of {@link spawnHost}. */
async function childHost(spec: string): Promise<void> {
	const o = JSON.parse(spec) as Parameters<typeof spawnHost>[0];
	const send = (m: ChildMessage) => process.send?.(m);
	let local;
	try {
		local = await startLocalHost({
			...o,
			log: values.verbose ? log : undefined,
		});
	} catch (err) {
		send({ error: String(err) });
		process.exit(1);
	}
	const stop = async () => {
		await local.host.stop();
		process.exit(0);
	};
	process.on("message", (m) => {
		if (m === "health") send({ health: local.host.health() });
		else if (m === "stop") void stop();
	});
	// The parent died: stop the sandboxes rather than leave them behind.
	process.on("disconnect", () => void stop());
	send({ ready: { url: local.url, id: local.id } });
}

// ------------------------------------------------------------------- main

async function main(): Promise<void> {
	const docker = await dockerStatus();
	const terminalDriver = (values.driver ??
		(docker.ok ? "docker" : "workspace")) as "docker" | "workspace";
	if (terminalDriver === "docker" && !docker.ok)
		throw new Error(`--driver docker: ${docker.why}`);
	if (!docker.ok && KINDS.includes("terminal"))
		log(
			`docker unavailable (${docker.why}): the terminal workload runs in workspaces`,
		);

	const seed = int("seed", values.seed) ?? 1;
	const loadStart = loadavg().map((x) => round(x, 2));
	const persist = mkdtempSync(path.join(tmpdir(), "trellis-e2e-state-"));
	const dataDir = mkdtempSync(path.join(tmpdir(), "trellis-e2e-direct-"));
	const runTag = `e2e${Date.now().toString(36)}`;
	let stack: LocalStack | null = null;
	let copy: string | null = null;
	const results: WorkloadResult[] = [];
	const started = performance.now();
	try {
		let start = startLocalStack;
		if (values.snapshot) {
			copy = mkdtempSync(path.join(tmpdir(), "trellis-e2e-tree-"));
			// Tracked and untracked files that are not ignored: what wrangler
			// dev would bundle from this tree right now.
			execFileSync(
				"sh",
				[
					"-c",
					`git ls-files -z -c -o --exclude-standard | tar --null --ignore-failed-read -T - -cf - | tar -x -C "${copy}"`,
				],
				{ cwd: REPO_ROOT, stdio: ["ignore", "ignore", "inherit"] },
			);
			symlinkSync(
				path.join(REPO_ROOT, "node_modules"),
				path.join(copy, "node_modules"),
			);
			// The copy's module resolves REPO_ROOT to the copy: wrangler runs there.
			start = (
				(await import(
					path.join(copy, "bin", "local-stack.ts")
				)) as typeof import("../bin/local-stack.ts")
			).startLocalStack;
			log(`--snapshot: the Worker runs from a copy of the tree in ${copy}`);
		}
		log("starting the local stack (wrangler dev)...");
		stack = await start({
			persistTo: persist,
			quiet: !values.verbose,
			vars: VARS,
		});
		const admin = new TrellisClient({ url: stack.url, key: stack.adminKey });
		const needed = new Set<Driver>(
			KINDS.map((k) =>
				k === "terminal"
					? terminalDriver
					: k === "sql"
						? "sqlite"
						: "workspace",
			),
		);
		const direct = await loadDrivers(
			{
				dataDir,
				instance: `e2e-${runTag}`,
				maxOutputBytes: 1 << 20,
				execTimeoutMs: 120_000,
			},
			[...needed],
		);
		for (const [name, why] of direct.unavailable)
			throw new Error(`driver ${name} cannot run here: ${why}`);

		for (const kind of KINDS) {
			const size = {
				...SIZES[kind],
				...(values.tasks && { tasks: int("tasks", values.tasks)! }),
				...(values.group && { group: int("group", values.group)! }),
				...(values.epochs && { epochs: int("epochs", values.epochs)! }),
			};
			const options: WorkloadOptions = {
				seed,
				...size,
				driver: terminalDriver,
			};
			const w = workload(kind, options);
			const total = callCount(w);
			log(`\n${w.title}: ${w.groups.length} groups, ${total} calls`);

			// Its own project, keys and host: host latencies per workload.
			const project = `${runTag}-${kind}`;
			await admin.createProject(project);
			const trainerKey = (await admin.createKey({ role: "trainer", project }))
				.key;
			const hostKey = (await admin.createKey({ role: "host", project })).key;
			const client = new TrellisClient({ url: stack.url, key: trainerKey });
			const host = await spawnHost({
				worker: stack.url,
				key: hostKey,
				drivers: [w.template.driver],
				name: `e2e-${kind}`,
			});
			try {
				const driver = direct.drivers.get(w.template.driver)!;
				let bar = progress(total, "calls without Trellis");
				const base = await runDirect(driver, w, () => bar.tick());
				bar.end();

				bar = progress(total, "calls with Trellis");
				const m0 = performance.now();
				const managed = await runManaged(client, w, {
					prefix: runTag,
					oracle: values.oracle,
					onCall: () => bar.tick(),
					onGroup: (g) => bar.label(`(${g.task}, epoch ${g.epoch})`),
				});
				const wallMs = performance.now() - m0;
				bar.end();

				const tasks = [
					...new Set(w.groups.map((g) => runTask(runTag, g.task))),
				];
				const graph = await graphFigures(client, tasks);
				const r = summarize(
					w,
					size,
					base,
					managed,
					wallMs,
					graph,
					await host.health(),
				);
				results.push(r);
				log(
					`${kind}: hit rate ${pct(r.hitRate)}, median ${msf(r.without.medianMs)} → ${msf(r.with.medianMs)} (${r.speedup.median.toFixed(1)}×)`,
				);
			} finally {
				await host.stop();
			}
		}
		for (const d of direct.drivers.values()) await d.stop?.();
	} finally {
		await stack?.stop();
		rmSync(persist, { recursive: true, force: true });
		rmSync(dataDir, { recursive: true, force: true });
		if (copy !== null) rmSync(copy, { recursive: true, force: true });
	}

	const table = markdown(results);
	const report = {
		date: new Date().toISOString(),
		command: ["npm run bench:e2e", ...process.argv.slice(2)]
			.join(" ")
			.replace("e2e ", "e2e -- "),
		machine: {
			// Other work on the machine slows both sides: the load says how much.
			loadAverage: { start: loadStart, end: loadavg().map((x) => round(x, 2)) },
			cpus: cpus().length,
			cpu: cpus()[0]?.model ?? "unknown",
			memoryGiB: round(totalmem() / (1 << 30), 1),
			node: process.version,
			docker: docker.ok,
		},
		commit: gitHead(),
		seed,
		vars: VARS,
		oracle: values.oracle,
		durationS: round((performance.now() - started) / 1000, 1),
		results,
		table,
	};
	mkdirSync(path.dirname(OUT), { recursive: true });
	writeFileSync(OUT, `${JSON.stringify(report, null, "\t")}\n`);
	console.log(table);
	console.log("");
	for (const r of results) console.log(`- ${r.kind}: ${r.standIns}`);
	log(`\nwrote ${path.relative(process.cwd(), OUT)} (${report.durationS} s)`);
}

(values["child-host"] ? childHost(values["child-host"]) : main()).catch(
	(err: unknown) => {
		console.error(err instanceof Error ? (err.stack ?? err.message) : err);
		process.exitCode = 1;
	},
);
