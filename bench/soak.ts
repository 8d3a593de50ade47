/**
 * The soak benchmark (issue 4, "Soak"): many rollouts over many tasks for
 * several minutes against a real `wrangler dev`, with budgets so small that
 * eviction runs all the time and faults injected while it does; then a check
 * that every acknowledged record is either still retrievable with the same
 * output or named by its task's eviction log.
 *
 *     npx tsx bench/soak.ts [--minutes 4] [--tasks 24] [--quick]
 *
 * The workload: groups of rollouts (GRPO-like: the rollouts of a group run
 * the same task at once, so identical misses and records race) walk random
 * paths of state-changing calls that branch from shared prefixes (a skewed
 * choice at every step), with stateless reads in between. Every call is
 * looked up (by cursor or by history); a miss restores the returned snapshot
 * now and then (and checks its bytes), releases its lease or leaves it to
 * expire, "executes" and records from `resume` with the replay, as
 * `CachedToolExecutor` does. Some state-changing calls upload a snapshot
 * first; some outputs are larger than the (lowered) inline limit, a few of
 * them shared between calls so content-addressed blobs are shared too.
 * Outputs and snapshot bytes are pure functions of (task, id), so every hit,
 * every record and every restored snapshot can be checked exactly.
 *
 * Faults, while that runs: the Worker is restarted (its whole process group
 * stopped, alternately with SIGTERM and SIGKILL, and started again on the same
 * state directory and port); some requests are aborted by the client a few
 * ms after they are sent (mid-upload, mid-response); the cron sweep is
 * triggered through wrangler dev's `/cdn-cgi/handler/scheduled` (always on
 * in wrangler 4, so `--test-scheduled` is not needed).
 *
 * The check, after traffic stops and one more restart (so nothing is served
 * from an isolate's memory): every (task, id) acknowledged by a record
 * (`recorded` or `exists`) is read back with `GET results/:id`. Present with
 * the same output: fine. Absent: it may have been evicted, and then the
 * task's eviction log (`GET evictions`) names it, one entry a node eviction
 * removed, with an eviction after the last record that acknowledged it was
 * sent. lost = missing records the log does not name + records read back
 * with another output + records that could not be read. (Should a task's
 * log have let old entries go, its missing records not named are held
 * against the count it let go instead, and the report says so.) The log
 * must also agree with the task's stats: at least as many node entries as
 * `evictions.node_budget` counts. The graph export is checked too: every node's
 * parent is present, every snapshot a node claims can be downloaded with its
 * bytes intact. Violations seen while running (a hit with the wrong output,
 * a conflict, a leased snapshot that is gone) are kept with samples.
 *
 * Writes bench/results/soak.json (`--quick`: soak-quick.json.tmp) and the
 * Worker's log to bench/results/soak-server.log.tmp. Exit status 1 if lost >
 * 0 or any invariant was violated, 2 if the run itself failed.
 *
 * Flags: --minutes N --tasks N --groups N --group-size N --restart-every S
 *        --sweep-every S --abort-rate P --seed N --out FILE --quick
 *        --tree worktree|head (the Worker's code: a frozen copy of the
 *        working tree, the default, or of HEAD; see freezeTree)
 */
import { AsyncLocalStorage } from "node:async_hooks";
import { execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import {
	copyFileSync,
	createWriteStream,
	existsSync,
	lstatSync,
	mkdirSync,
	mkdtempSync,
	rmSync,
	symlinkSync,
	writeFileSync,
} from "node:fs";
import { cpus, loadavg, tmpdir, totalmem, type } from "node:os";
import { dirname, join } from "node:path";
import { parseArgs } from "node:util";
import { fetch as undiciFetch } from "undici";
import {
	TrellisClient,
	TrellisError,
	type RecordInput,
} from "../client/http.ts";
import type { GraphNode, Miss, SnapshotRef } from "../core/api.ts";
import {
	callKey,
	childId,
	finalState,
	obsId,
	pathIds,
	ROOT_ID,
	type Call,
} from "../core/ids.ts";
import type { LocalStack, LocalStackOptions } from "../bin/local-stack.ts";

// ---------------------------------------------------------------- options

const { values: flags } = parseArgs({
	options: {
		minutes: { type: "string" },
		tasks: { type: "string" },
		groups: { type: "string" },
		"group-size": { type: "string" },
		"restart-every": { type: "string" },
		"sweep-every": { type: "string" },
		"abort-rate": { type: "string" },
		seed: { type: "string" },
		out: { type: "string" },
		quick: { type: "boolean", default: false },
		tree: { type: "string", default: "worktree" },
	},
	strict: true,
});

function num(v: string | undefined, fallback: number, name: string): number {
	if (v === undefined) return fallback;
	const n = Number(v);
	if (!Number.isFinite(n) || n < 0) throw new Error(`--${name}: ${v}?`);
	return n;
}

const quick = flags.quick;
if (flags.tree !== "worktree" && flags.tree !== "head")
	throw new Error(`--tree: ${flags.tree}? (worktree or head)`);
const opts = {
	minutes: num(flags.minutes, quick ? 0.75 : 4, "minutes"),
	tasks: Math.max(1, Math.floor(num(flags.tasks, quick ? 6 : 24, "tasks"))),
	groups: Math.max(1, Math.floor(num(flags.groups, quick ? 2 : 4, "groups"))),
	groupSize: Math.max(1, Math.floor(num(flags["group-size"], 4, "group-size"))),
	// At least a second apart, so neither loop can spin.
	restartEverySec: Math.max(
		1,
		num(flags["restart-every"], quick ? 15 : 40, "restart-every"),
	),
	sweepEverySec: Math.max(
		1,
		num(flags["sweep-every"], quick ? 8 : 15, "sweep-every"),
	),
	abortRate: Math.min(1, num(flags["abort-rate"], 0.02, "abort-rate")),
	seed: Math.floor(num(flags.seed, 1, "seed")),
	tree: flags.tree as "worktree" | "head",
	// A smoke run must not overwrite the committed figures; *.tmp is ignored.
	out:
		flags.out ??
		(quick ? "bench/results/soak-quick.json.tmp" : "bench/results/soak.json"),
	serverLog: "bench/results/soak-server.log.tmp",
};

/**
 * Worker variables: budgets small enough that every task is evicted from
 * within a minute, a low inline limit so R2 holds many outputs, and a
 * one-minute orphan grace so the sweeps' orphan pass can act within a run
 * (a snapshot uploaded for a record that never came). Idle-task expiry keeps
 * its default (30 days): deleting whole tasks would lose records that no
 * `node_budget` eviction accounts for, and is not what this soak is about.
 */
const VARS: Record<string, string> = {
	BUDGET_NODES: "200",
	BUDGET_SNAPSHOTS: "10",
	BUDGET_SNAPSHOT_BYTES: String(64 << 10),
	BUDGET_OUTPUT_BYTES: String(256 << 10),
	OUTPUT_INLINE_MAX_BYTES: "4096",
	ORPHAN_GRACE_MS: "60000",
};
const BUDGET_NODES = Number(VARS.BUDGET_NODES);
const INLINE_MAX = Number(VARS.OUTPUT_INLINE_MAX_BYTES);
/**
 * A snapshot uploaded longer ago than this is not put in a record any more
 * (the record is retried without it): the orphan sweep may take a blob no
 * node points at once it is ORPHAN_GRACE_MS old, so a client that sat out a
 * restart between its upload and its record must upload again.
 */
const SNAPSHOT_REF_MAX_AGE_MS = 30_000;

// Every wait below is bounded, so a wedged stack ends the run instead of
// hanging it.
const OP_ATTEMPTS = 40;
const OP_BUDGET_MS = 90_000;
const REQUEST_TIMEOUT_MS = 20_000;
const HARD_TIMEOUT_MS = 60_000;
const RESTART_WAIT_MS = 180_000;
const CHECK_BUDGET_MS = 10 * 60_000;
const DRAIN_BUDGET_MS = 120_000;

// ------------------------------------------------- deterministic content

function sha(text: string | Uint8Array): string {
	return createHash("sha256").update(text).digest("hex");
}

/** `n` characters of hex, repeating the digest of `seed`. */
function filler(seed: string, n: number): string {
	const block = sha(seed);
	return block.repeat(Math.ceil(n / block.length)).slice(0, n);
}

const pooled = new Map<string, string>();

/**
 * The output of the call with result id `id` in `task`: most are small;
 * about 8% are one of four large outputs per task (shared by many calls, so
 * their R2 blob is shared: eviction must keep it while another node uses it);
 * about 4% are large and unique. Large means above the inline limit.
 */
function outputOf(task: string, id: string): string {
	const h = sha(`${task}\u0000${id}`);
	const b = parseInt(h.slice(0, 2), 16);
	if (b < 20) {
		const k = parseInt(h.slice(2, 4), 16) % 4;
		const key = `${task}/pool/${k}`;
		let text = pooled.get(key);
		if (text === undefined) {
			text = `pooled ${k}\n${filler(key, INLINE_MAX + 1000 + k * 1500)}`;
			pooled.set(key, text);
		}
		return text;
	}
	if (b < 30) return `unique\n${filler(h, INLINE_MAX + 200 + b * 97)}`;
	return `ok ${id.slice(0, 12)}\n${filler(h, 40 + (b % 6) * 64)}`;
}

function execOf(id: string): number {
	return 20 + (parseInt(id.slice(0, 4), 16) % 3000);
}

/** The snapshot blob of `state`: 2 to 12 KiB, a pure function of (task, state). */
function snapshotOf(task: string, state: string): Uint8Array {
	const h = sha(`${task}\u0000snap\u0000${state}`);
	const n = 2048 + (parseInt(h.slice(0, 4), 16) % 10240);
	return new TextEncoder().encode(filler(h, n));
}

function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
	if (a.byteLength !== b.byteLength) return false;
	for (let i = 0; i < a.byteLength; i++) if (a[i] !== b[i]) return false;
	return true;
}

/** mulberry32: a small seeded generator, one per rollout group. */
function rng(seed: number): () => number {
	let a = seed >>> 0;
	return () => {
		a = (a + 0x6d2b79f5) >>> 0;
		let t = a;
		t = Math.imul(t ^ (t >>> 15), t | 1);
		t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
		return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
	};
}

const int = (r: () => number, n: number) => Math.floor(r() * n);

/** A branch at one step: 0 most often, so rollouts share long prefixes. */
function branch(r: () => number): number {
	const x = r();
	return x < 0.55 ? 0 : x < 0.8 ? 1 : x < 0.93 ? 2 : 3;
}

// ----------------------------------------------------------- bookkeeping

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const now = () => Date.now();

type OpKind =
	| "lookup"
	| "record"
	| "snapshot_put"
	| "snapshot_get"
	| "lease"
	| "renew"
	| "release"
	| "result"
	| "stats"
	| "graph"
	| "evictions";

const requests: Record<string, number> = {};
/** Failed attempts by kind: `aborted by the soak`, `cut by a restart`, `409 stale_cursor`, ... */
const errors: Record<string, number> = {};
const faults = {
	restartsGraceful: 0,
	restartsKilled: 0,
	/** Requests picked for an abort (an abort after the answer arrived does nothing). */
	abortsArmed: 0,
	/** Requests the abort actually cut. */
	abortsCut: 0,
	sweeps: 0,
	sweepFailures: 0,
};
const events = {
	rollouts: 0,
	rolloutsAbandoned: 0,
	lookups: 0,
	hits: 0,
	misses: 0,
	staleCursors: 0,
	unknownStateFallbacks: 0,
	recordsSent: 0,
	/** Results acknowledged (`recorded` or `exists`), repeats included. */
	acks: 0,
	recorded: 0,
	exists: 0,
	snapshotsUploaded: 0,
	snapshotRefsDropped: 0,
	restores: 0,
	leasesReleased: 0,
	leasesLeftToExpire: 0,
	leasesGoneBeforeRelease: 0,
	explicitLeases: 0,
	renewals: 0,
};
const restartDowntimesMs: number[] = [];

interface Violation {
	kind: string;
	detail: unknown;
}
const violations: Violation[] = [];
const violationCounts: Record<string, number> = {};
function violation(kind: string, detail: unknown): void {
	violationCounts[kind] = (violationCounts[kind] ?? 0) + 1;
	// Samples, not all of them: a systematic fault would fill memory.
	if (violations.filter((v) => v.kind === kind).length < 10)
		violations.push({ kind, detail });
}

/** Exact requests and responses of server errors (5xx), a few of each. */
const serverErrorSamples: {
	at: string;
	method: string;
	url: string;
	request: string;
	status: number;
	response: string;
}[] = [];

/** What was acknowledged: task → result id → the output's digest and parent. */
interface LedgerEntry {
	sha: string;
	parent: string;
	ackedAt: number;
	/**
	 * When the last record that acknowledged it was first sent: an eviction
	 * that accounts for it being gone must come after (see the check).
	 */
	sentAt: number;
}
const ledger = new Map<string, Map<string, LedgerEntry>>();

function acknowledge(
	task: string,
	id: string,
	parent: string,
	output: string,
	sentAt: number,
) {
	let m = ledger.get(task);
	if (!m) ledger.set(task, (m = new Map()));
	const digest = sha(output);
	const prior = m.get(id);
	if (prior && prior.sha !== digest)
		violation("two outputs acknowledged for one id", { task, id });
	if (!prior) m.set(id, { sha: digest, parent, ackedAt: now(), sentAt });
	else prior.sentAt = Math.max(prior.sentAt, sentAt);
}

// ------------------------------------------------------------- the stack

/**
 * `wrangler dev` watches its sources and reloads the Worker when one
 * changes; in a tree other people are editing that would be an extra,
 * uncounted restart mid-soak. The Worker runs from a copy instead: by
 * default of the working tree as it is at the start (tracked and untracked,
 * not ignored files), or with `--tree head` of the last commit.
 */
function freezeTree(kind: "worktree" | "head"): string {
	const root = execFileSync("git", ["rev-parse", "--show-toplevel"], {
		encoding: "utf8",
	}).trim();
	const copy = mkdtempSync(join(tmpdir(), "trellis-soak-tree-"));
	if (kind === "head") {
		execFileSync("sh", ["-c", `git archive HEAD | tar -x -C "${copy}"`], {
			cwd: root,
		});
	} else {
		const files = execFileSync(
			"git",
			["ls-files", "-z", "--cached", "--others", "--exclude-standard"],
			{ cwd: root, encoding: "utf8", maxBuffer: 64 << 20 },
		)
			.split("\0")
			.filter((f) => f !== "");
		for (const f of files) {
			const from = join(root, f);
			// A tracked file deleted in the working tree is not part of it.
			if (!existsSync(from) || !lstatSync(from).isFile()) continue;
			mkdirSync(dirname(join(copy, f)), { recursive: true });
			copyFileSync(from, join(copy, f));
		}
	}
	symlinkSync(join(root, "node_modules"), join(copy, "node_modules"));
	return copy;
}

function git(args: string[]): string | null {
	try {
		return execFileSync("git", args, { encoding: "utf8" }).trim();
	} catch {
		return null;
	}
}

const stateDir = mkdtempSync(join(tmpdir(), "trellis-soak-state-"));
// What the Worker runs, taken when the tree is frozen: others may commit
// while the soak runs.
const frozen = {
	commit: git(["rev-parse", "HEAD"]),
	uncommitted:
		opts.tree === "worktree"
			? (git(["status", "--porcelain"])?.split("\n").filter(Boolean) ?? null)
			: [],
	/** A digest of `git diff HEAD`: the tracked changes the copy carries. */
	diff:
		opts.tree === "worktree"
			? sha(git(["diff", "HEAD"]) ?? "").slice(0, 16)
			: null,
};
const treeDir = freezeTree(opts.tree);
const { startLocalStack, freePort } = (await import(
	join(treeDir, "bin", "local-stack.ts")
)) as typeof import("../bin/local-stack.ts");

// The Worker's log (wrangler at info level: every request, every
// console.error with its stack) goes to a file, not the terminal: it is
// where a 500 is explained. startLocalStack echoes to process.stderr when
// not quiet, so stderr is split: the soak's own lines still reach the
// terminal through `say`.
mkdirSync(dirname(opts.serverLog), { recursive: true });
const serverLog = createWriteStream(opts.serverLog);
const stderrWrite = process.stderr.write.bind(process.stderr);
process.stderr.write = ((chunk: string | Uint8Array) => {
	serverLog.write(chunk);
	return true;
}) as typeof process.stderr.write;
function say(line: string): void {
	stderrWrite(line.endsWith("\n") || line.endsWith("\r") ? line : line + "\n");
}

const port = await freePort();
const stackOptions: LocalStackOptions = {
	persistTo: stateDir,
	port,
	quiet: false,
	vars: VARS,
	startTimeoutMs: 120_000,
};
let stack: LocalStack;
let restarting = false;
let epoch = 0;
let ready: Promise<void> = Promise.resolve();
let client: TrellisClient;

/** What the fetch below did to the attempt it serves, for the hang report. */
interface AttemptContext {
	abortArmed: boolean;
	abortFiredAfterMs: number | null;
}
const attemptContext = new AsyncLocalStorage<AttemptContext>();

/** Whether the fetch below injects aborts (only while traffic runs). */
let injecting = false;

class InjectedAbort extends Error {
	override name = "InjectedAbort";
}

class HardTimeout extends Error {
	override name = "HardTimeout";
}

/**
 * `fetch` with fault injection: a few requests are aborted 0–40 ms after
 * they start (before the server answers, mid-body or mid-response), and the
 * exact request and response of every 5xx are kept for the report.
 *
 * It is undici 7's fetch, not Node 20's own (undici 6.24): aborted while a
 * large body is being sent, Node 20's fetch sometimes never settles (14 of
 * 1,200 aborted 60 KB records in a trial; undici 7: none), and each such
 * hang would stall a rollout for a minute and measure the client, not the
 * server.
 */
const injectingFetch: typeof fetch = async (input, init) => {
	// One controller per request, fed by the caller's signal and our timers;
	// AbortSignal.any would do, but this keeps every path explicit.
	const ctl = new AbortController();
	const outer = init?.signal;
	if (outer) {
		if (outer.aborted) ctl.abort(outer.reason);
		else
			outer.addEventListener("abort", () => ctl.abort(outer.reason), {
				once: true,
			});
	}
	if (injecting && Math.random() < opts.abortRate) {
		faults.abortsArmed++;
		const attempt = attemptContext.getStore();
		const sent = now();
		if (attempt) attempt.abortArmed = true;
		setTimeout(() => {
			if (attempt) attempt.abortFiredAfterMs = now() - sent;
			ctl.abort(new InjectedAbort());
		}, Math.random() * 40).unref();
	}
	const res = (await undiciFetch(
		input as Parameters<typeof undiciFetch>[0],
		{ ...init, signal: ctl.signal } as Parameters<typeof undiciFetch>[1],
	)) as unknown as Response;
	if (res.status >= 500 && serverErrorSamples.length < 20) {
		const body = init?.body;
		serverErrorSamples.push({
			at: new Date().toISOString(),
			method: init?.method ?? "GET",
			url: String(input),
			request:
				typeof body === "string"
					? body.slice(0, 2000)
					: body
						? `<${(body as Uint8Array).byteLength ?? "?"} bytes>`
						: "",
			status: res.status,
			response: (await res.clone().text()).slice(0, 2000),
		});
	}
	return res;
};

function makeClient(): TrellisClient {
	// Retries are the soak's (op below), so each attempt is counted.
	return new TrellisClient({
		url: stack.url,
		key: stack.trainerKey,
		retries: 0,
		timeoutMs: REQUEST_TIMEOUT_MS,
		fetch: injectingFetch,
	});
}

async function startStack(): Promise<LocalStack> {
	for (let attempt = 1; ; attempt++) {
		try {
			return await startLocalStack(stackOptions);
		} catch (err) {
			if (attempt >= 3) throw err;
			say(`start failed (attempt ${attempt}), again: ${err}`);
			await sleep(2000);
		}
	}
}

/**
 * Stops the Worker and starts it again on the same state and port: SIGTERM
 * lets wrangler shut workerd down; SIGKILL to the whole process group is a
 * crash. Requests meanwhile fail and are retried once it is back.
 */
async function restart(kind: "graceful" | "kill"): Promise<void> {
	let done!: () => void;
	ready = new Promise((r) => (done = r));
	restarting = true;
	epoch++;
	const t0 = now();
	try {
		if (kind === "kill") {
			try {
				process.kill(-stack.pid, "SIGKILL");
			} catch {
				// Already gone.
			}
		}
		await stack.stop();
		stack = await startStack();
		client = makeClient();
	} finally {
		restarting = false;
		restartDowntimesMs.push(now() - t0);
		done();
	}
}

// ------------------------------------------------------------ requests

type Outcome<T> =
	| { ok: true; value: T }
	| { ok: false; status: number; code: string; message: string };

function injected(err: unknown): boolean {
	if (err instanceof InjectedAbort) return true;
	if (err instanceof Error && err.cause instanceof InjectedAbort) return true;
	// An abort while the body is read surfaces as the reader's AbortError.
	return err instanceof Error && err.name === "AbortError";
}

function hardTimeout(err: unknown): boolean {
	return (
		err instanceof HardTimeout ||
		(err instanceof Error && err.cause instanceof HardTimeout)
	);
}

let stopping = false;

/** Attempts that got no answer at all within HARD_TIMEOUT_MS. */
const hangs: {
	kind: OpKind;
	attempt: number;
	startedAt: string;
	/** Restarts before it was sent and when it was given up. */
	epochAtStart: number;
	epochNow: number;
	/** Whether the soak meant to abort it, and when the abort fired. */
	abortArmed: boolean;
	abortFiredAfterMs: number | null;
}[] = [];

/** Ops under way, to say what a stalled soak is waiting for. */
const inFlight = new Map<
	number,
	{ kind: OpKind; since: number; attempt: number }
>();
let opSeq = 0;

/**
 * One API call with the soak's retries: after an abort, a network failure
 * or a 5xx it waits for a restart to finish and tries again (bounded in
 * attempts and time); a 4xx is returned to the caller, who knows whether it
 * is expected (a stale cursor after an eviction) or a violation.
 */
async function op<T>(
	kind: OpKind,
	fn: (c: TrellisClient) => Promise<T>,
	retry = true,
): Promise<Outcome<T>> {
	const t0 = now();
	const seq = opSeq++;
	try {
		return await attempts();
	} finally {
		inFlight.delete(seq);
	}
	async function attempts(): Promise<Outcome<T>> {
		for (let attempt = 1; ; attempt++) {
			inFlight.set(seq, { kind, since: now(), attempt });
			if (restarting)
				await Promise.race([ready, sleep(RESTART_WAIT_MS)]).catch(() => {});
			const seen = epoch;
			requests[kind] = (requests[kind] ?? 0) + 1;
			let failure: { status: number; code: string; message: string };
			// A hard limit on every attempt that does not rely on aborting the
			// fetch: the client sets no timeout on snapshot transfers, and an
			// aborted fetch has been seen never to settle (see injectingFetch).
			let timer: NodeJS.Timeout | undefined;
			let attemptCtx: AttemptContext | null = null;
			const attemptStarted = now();
			try {
				const context: AttemptContext = {
					abortArmed: false,
					abortFiredAfterMs: null,
				};
				attemptCtx = context;
				const call = attemptContext.run(context, () => fn(client));
				call.catch(() => {});
				const limit = new Promise<never>((_, reject) => {
					timer = setTimeout(() => reject(new HardTimeout()), HARD_TIMEOUT_MS);
				});
				const value = await Promise.race([call, limit]);
				clearTimeout(timer);
				return { ok: true, value };
			} catch (err) {
				if (hardTimeout(err) && hangs.length < 20)
					hangs.push({
						kind,
						attempt,
						startedAt: new Date(attemptStarted).toISOString(),
						epochAtStart: seen,
						epochNow: epoch,
						abortArmed: attemptCtx?.abortArmed ?? false,
						abortFiredAfterMs: attemptCtx?.abortFiredAfterMs ?? null,
					});
				let key: string;
				// The abort fired during this attempt: whatever came back was
				// cut by it, even an error whose body it cut (the client then
				// reports a `network_error`: the answer's code is unknown).
				if (injected(err) || attemptCtx?.abortFiredAfterMs != null) {
					faults.abortsCut++;
					key = "aborted by the soak";
					failure = { status: 0, code: "aborted", message: String(err) };
				} else if (hardTimeout(err)) {
					key = "no answer in 60 s";
					failure = { status: 0, code: "hard_timeout", message: String(err) };
				} else if (err instanceof TrellisError) {
					failure = {
						status: err.status,
						code: err.code,
						message: err.message,
					};
					key =
						err.status === 0
							? restarting || epoch !== seen
								? "cut by a restart"
								: err.code
							: `${err.status} ${err.code}`;
				} else {
					// A failure outside the client's own handling (the client
					// wraps a body cut off while it is read, so this is not
					// expected): as retryable as a network error.
					const name = err instanceof Error ? err.name : typeof err;
					key =
						restarting || epoch !== seen
							? "cut by a restart"
							: `client ${name}: ${err instanceof Error ? err.message : err}`;
					failure = { status: 0, code: name, message: String(err) };
				}
				errors[key] = (errors[key] ?? 0) + 1;
				clearTimeout(timer);
				const retryable = failure.status === 0 || failure.status >= 500;
				if (
					!retryable ||
					!retry ||
					attempt >= OP_ATTEMPTS ||
					now() - t0 > OP_BUDGET_MS
				)
					return { ok: false, ...failure };
				await sleep(Math.min(2000, 50 * 2 ** Math.min(attempt, 6)));
			}
		}
	}
}

// ------------------------------------------------------------- rollouts

const taskNames = Array.from(
	{ length: opts.tasks },
	(_, i) => `soak-${String(i).padStart(3, "0")}`,
);

/** Rollouts under way and where they are, for the stall report. */
const active = new Set<Rollout>();
/** What the soak is doing, for the stall report. */
let phase = "starting";

interface Rollout {
	task: string;
	where: string;
	r: () => number;
	/** Every call so far, state-changing or not. */
	history: Call[];
	state: string;
	/** The state was held when last seen, so a cursor lookup may use it. */
	cursorOk: boolean;
}

function recorded(task: string, c: Call, id: string): RecordInput["calls"][0] {
	return {
		tool: c.tool,
		args: c.args ?? null,
		mutates: c.mutates !== false,
		output: outputOf(task, id),
		exitCode: 0,
		execMs: execOf(id),
	};
}

/** Restores (sometimes) the miss's snapshot, then releases its lease or leaves it. */
async function useLease(ro: Rollout, miss: Miss): Promise<void> {
	if (miss.snapshot === null) return;
	if (miss.lease === null) {
		violation("a miss with a snapshot and no lease", { task: ro.task, miss });
		return;
	}
	const lease = miss.lease;
	const snap = miss.snapshot;
	if (ro.r() < 0.3) {
		events.restores++;
		const got = await op("snapshot_get", (c) =>
			c.getSnapshot(ro.task, snap.state),
		);
		if (got.ok) {
			if (!sameBytes(got.value, snapshotOf(ro.task, snap.state)))
				violation("a restored snapshot has other bytes", {
					task: ro.task,
					state: snap.state,
					bytes: got.value.byteLength,
				});
		} else if (got.status === 404 && now() < lease.expiresAt - 50) {
			// Invariant 10: eviction never deletes a leased snapshot.
			violation("a leased snapshot is gone", {
				request: `GET /v1/tasks/${ro.task}/snapshots/${snap.state}`,
				response: `${got.status} ${got.code}: ${got.message}`,
				lease,
				leaseMsLeft: lease.expiresAt - now(),
			});
		}
	}
	if (ro.r() < 0.75) {
		const rel = await op("release", (c) => c.releaseLease(ro.task, lease.id));
		if (rel.ok) events.leasesReleased++;
		else if (rel.status === 409 || rel.status === 404)
			events.leasesGoneBeforeRelease++;
	} else {
		events.leasesLeftToExpire++;
	}
}

/** Records what a miss executed: the replay and the call, from `resume`. */
async function recordMiss(
	ro: Rollout,
	call: Call,
	id: string,
	miss: Miss,
): Promise<boolean> {
	const replay = miss.replay.map((x) => ({
		call: { tool: x.tool, args: x.args, mutates: true } as Call,
		id: x.id,
	}));
	// The replay is a path from `resume`: its ids must be what we compute.
	const steps = pathIds(
		replay.map((x) => x.call),
		miss.resume,
	);
	if (steps.some((s, i) => s.id !== replay[i].id))
		violation("a replay whose ids are not its path from resume", {
			task: ro.task,
			resume: miss.resume,
			replay: miss.replay.map((x) => x.id),
		});
	// Executing the call: a token wait, the cache is what is under test.
	await sleep(int(ro.r, 15));

	let snapshot: { ref: SnapshotRef; at: number } | null = null;
	if (call.mutates !== false && ro.r() < 0.15) {
		const put = await op("snapshot_put", (c) =>
			c.putSnapshot(ro.task, id, snapshotOf(ro.task, id), "soak"),
		);
		if (put.ok) {
			events.snapshotsUploaded++;
			snapshot = { ref: put.value, at: now() };
		}
	}
	const body = (from: string, calls: { call: Call; id: string }[]) => () => {
		const out = calls.map((x) => recorded(ro.task, x.call, x.id));
		if (snapshot !== null) {
			if (now() - snapshot.at < SNAPSHOT_REF_MAX_AGE_MS)
				out[out.length - 1].snapshot = snapshot.ref;
			else {
				events.snapshotRefsDropped++;
				snapshot = null;
			}
		}
		return { from, calls: out };
	};

	let from = miss.resume;
	let run = [...replay, { call, id }];
	events.recordsSent++;
	// Before every attempt: whichever committed, it was sent after this.
	const sentAt = now();
	let res = await op("record", (c) => c.record(ro.task, body(from, run)()));
	if (!res.ok && res.code === "unknown_state") {
		// `resume` was evicted between the lookup and the record: record the
		// whole path from the root, as a client that lost its snapshot would.
		events.unknownStateFallbacks++;
		from = ROOT_ID;
		const path = ro.history.filter((c) => c.mutates !== false);
		const ids = pathIds(path);
		run = [...path.map((c, i) => ({ call: c, id: ids[i].id })), { call, id }];
		events.recordsSent++;
		res = await op("record", (c) => c.record(ro.task, body(from, run)()));
	}
	if (!res.ok) return false;
	const r = res.value;
	const want = pathIds(
		run.map((x) => x.call),
		from,
	);
	if (
		r.results.length !== run.length ||
		r.state !==
			finalState(
				run.map((x) => x.call),
				from,
			)
	)
		violation("a record answer that does not match its request", {
			task: ro.task,
			from,
			ids: run.map((x) => x.id),
			response: r,
		});
	for (const [i, x] of r.results.entries()) {
		if (i >= run.length) break;
		if (x.id !== want[i].id) {
			violation("a record result with another id", { expected: want[i], x });
			continue;
		}
		if (x.status === "conflict") {
			// Outputs are pure functions of the id: a conflict means the
			// server compared against something other than what we sent.
			violation("a conflict on a deterministic output", {
				task: ro.task,
				id: x.id,
				from,
			});
			continue;
		}
		events.acks++;
		if (x.status === "recorded") events.recorded++;
		else events.exists++;
		acknowledge(ro.task, x.id, want[i].state, outputOf(ro.task, x.id), sentAt);
	}
	return true;
}

/** One call of a rollout: look it up; on a miss, execute and record. */
async function step(ro: Rollout, call: Call): Promise<boolean> {
	const mutating = call.mutates !== false;
	const key = callKey(call);
	const id = mutating ? childId(ro.state, key) : obsId(ro.state, key);
	const leaseTtlMs = 3000 + int(ro.r, 5000);
	const byHistory = () =>
		op("lookup", (c) =>
			c.lookup(ro.task, { history: ro.history, call, leaseTtlMs }),
		);
	events.lookups++;
	ro.where = `lookup ${call.tool}`;
	let res =
		ro.cursorOk && ro.r() < 0.7
			? await op("lookup", (c) =>
					c.lookup(ro.task, { cursor: ro.state, call, leaseTtlMs }),
				)
			: await byHistory();
	if (!res.ok && res.code === "stale_cursor") {
		// The state was evicted: the full history still works (fault 7).
		events.staleCursors++;
		res = await byHistory();
	}
	if (!res.ok) return false;
	const r = res.value;
	if (r.id !== id)
		violation("a lookup answered for another id", {
			task: ro.task,
			expected: id,
			got: r.id,
		});
	if (r.status === "hit") {
		events.hits++;
		if (r.output !== outputOf(ro.task, id))
			violation("a hit with another output", {
				request: { task: ro.task, history: ro.history, call },
				response: { ...r, output: r.output.slice(0, 200) },
			});
	} else {
		events.misses++;
		ro.where = "lease of the miss";
		await useLease(ro, r);
		ro.where = "record";
		if (!(await recordMiss(ro, call, id, r))) return false;
	}
	ro.history.push(call);
	if (mutating) ro.state = id;
	ro.cursorOk = true;
	ro.where = "explicit lease";
	if (ro.r() < 0.03) await explicitLease(ro);
	ro.where = "after a step";
	return true;
}

/** A lease taken on the rollout's state by hand: renewed, released or left. */
async function explicitLease(ro: Rollout): Promise<void> {
	if (ro.state === ROOT_ID) return;
	const ttlMs = 2000 + int(ro.r, 4000);
	// Not retried: a repeat after a lost answer would hold a second lease.
	const got = await op(
		"lease",
		(c) => c.createLease(ro.task, { state: ro.state, ttlMs }),
		false,
	);
	if (!got.ok) return;
	events.explicitLeases++;
	const id = got.value.id;
	if (ro.r() < 0.5) {
		const renewed = await op("renew", (c) => c.renewLease(ro.task, id, ttlMs));
		if (renewed.ok) events.renewals++;
	}
	if (ro.r() < 0.5) {
		const rel = await op("release", (c) => c.releaseLease(ro.task, id));
		if (rel.ok) events.leasesReleased++;
		else if (rel.status === 409 || rel.status === 404)
			events.leasesGoneBeforeRelease++;
	} else {
		events.leasesLeftToExpire++;
	}
}

async function rollout(task: string, r: () => number): Promise<void> {
	const ro: Rollout = {
		task,
		where: "start",
		r,
		history: [],
		state: ROOT_ID,
		cursorOk: false,
	};
	const depth = 3 + int(r, 8);
	active.add(ro);
	try {
		await walk(ro, depth);
	} finally {
		active.delete(ro);
	}
}

async function walk(ro: Rollout, depth: number): Promise<void> {
	const r = ro.r;
	for (let i = 0; i < depth; i++) {
		ro.where = `step ${i}`;
		if (stopping) return;
		if (r() < 0.4) {
			const read: Call = {
				tool: "read",
				args: { file: `f${int(r, 3)}` },
				mutates: false,
			};
			if (!(await step(ro, read))) return void events.rolloutsAbandoned++;
		}
		const edit: Call = {
			tool: "edit",
			args: { step: i, choice: branch(r) },
		};
		if (!(await step(ro, edit))) return void events.rolloutsAbandoned++;
	}
	events.rollouts++;
}

/** A group runs `groupSize` rollouts of one task at once, then picks another task. */
async function group(g: number, deadline: number): Promise<void> {
	const r = rng(opts.seed * 1000 + g);
	while (!stopping && now() < deadline) {
		const task = taskNames[int(r, taskNames.length)];
		const seeds = Array.from({ length: opts.groupSize }, () =>
			Math.floor(r() * 2 ** 32),
		);
		await Promise.all(seeds.map((s) => rollout(task, rng(s))));
	}
}

// ---------------------------------------------------------------- faults

async function restartLoop(deadline: number): Promise<void> {
	let n = 0;
	const r = rng(opts.seed + 7);
	for (;;) {
		const wait = opts.restartEverySec * 1000 * (0.8 + 0.4 * r());
		// No restart in the last stretch: the run ends with traffic flowing.
		if (now() + wait > deadline - 5000 || stopping) return;
		await sleep(wait);
		if (stopping) return;
		const kind = n++ % 2 === 0 ? "graceful" : "kill";
		say(`\nrestart ${n} (${kind === "kill" ? "SIGKILL" : "SIGTERM"})`);
		await restart(kind);
		if (kind === "kill") faults.restartsKilled++;
		else faults.restartsGraceful++;
		say(`restart ${n} done in ${restartDowntimesMs.at(-1)} ms`);
	}
}

/** The cron: wrangler dev runs the scheduled handler on this path. */
async function sweepOnce(): Promise<boolean> {
	try {
		const res = await fetch(`${stack.url}/cdn-cgi/handler/scheduled`, {
			signal: AbortSignal.timeout(60_000),
		});
		await res.text();
		return res.ok;
	} catch {
		return false;
	}
}

async function sweepLoop(deadline: number): Promise<void> {
	while (!stopping && now() + opts.sweepEverySec * 1000 < deadline) {
		await sleep(opts.sweepEverySec * 1000);
		if (stopping) return;
		if (restarting) continue;
		if (await sweepOnce()) faults.sweeps++;
		else faults.sweepFailures++;
	}
}

// -------------------------------------------------------------- progress

const sum = (o: Record<string, number>) =>
	Object.values(o).reduce((a, b) => a + b, 0);
const mmss = (ms: number) => {
	const s = Math.max(0, Math.round(ms / 1000));
	return `${Math.floor(s / 60)}:${String(s % 60).padStart(2, "0")}`;
};

function progressLine(t0: number, totalMs: number): string {
	const el = now() - t0;
	const frac = Math.min(1, el / totalMs);
	const bar = "#".repeat(Math.round(frac * 20)).padEnd(20, ".");
	const req = sum(requests);
	const hitRate = events.lookups
		? ((100 * events.hits) / events.lookups).toFixed(0)
		: "0";
	return (
		`soak ${mmss(el)}/${mmss(totalMs)} [${bar}] ${req} req ` +
		`(${(req / Math.max(1, el / 1000)).toFixed(0)}/s), ` +
		`${events.acks} acked, hits ${hitRate}%, ` +
		`restarts ${faults.restartsGraceful + faults.restartsKilled}, ` +
		`aborts ${faults.abortsCut}, sweeps ${faults.sweeps}, ` +
		`errors ${sum(errors)}, violations ${sum(violationCounts)}` +
		(restarting ? " (restarting)" : "")
	);
}

function startProgress(t0: number, totalMs: number): () => void {
	const tty = process.stderr.isTTY;
	let lastCount = -1;
	let lastChange = now();
	const timer = setInterval(
		() => {
			const line = progressLine(t0, totalMs);
			say(tty ? `\r${line}\u001b[K\r` : line);
			const count = sum(requests);
			if (count !== lastCount) {
				lastCount = count;
				lastChange = now();
			} else if (now() - lastChange > 30_000) {
				lastChange = now();
				const waits = [...inFlight.values()].map(
					(o) => `${o.kind} #${o.attempt} for ${mmss(now() - o.since)}`,
				);
				const where = [...active].map((r) => `${r.task}: ${r.where}`);
				say(
					`\nno request sent for 30 s (${phase}); ops: ${waits.join(", ") || "none"}; ` +
						`rollouts: ${where.join(", ") || "none"}`,
				);
			}
		},
		tty ? 1000 : 10_000,
	);
	return () => {
		clearInterval(timer);
		say(progressLine(t0, totalMs));
	};
}

// ------------------------------------------------------------- the check

interface TaskCheck {
	task: string;
	ledger: number;
	present: number;
	missing: number;
	wrong: number;
	unreadable: number;
	nodeBudgetEvictions: number;
	snapshotBudgetEvictions: number;
	orphanEvictions: number;
	/** Missing records the eviction log names. */
	accounted: number;
	/** Missing records the log does not name, held against its dropped entries. */
	accountedByCount: number;
	/** Entries the task's eviction log let go (0: the check is per record). */
	logDropped: number;
	lost: number;
	nodes: number;
	snapshots: number;
	graphNodes: number;
	graphOrphans: number;
	missingButInGraph: number;
	snapshotRefs: number;
	danglingSnapshots: number;
}

async function pool<T>(
	items: T[],
	width: number,
	deadline: number,
	fn: (x: T) => Promise<void>,
): Promise<number> {
	let next = 0;
	let done = 0;
	await Promise.all(
		Array.from({ length: width }, async () => {
			while (next < items.length && now() < deadline) {
				await fn(items[next++]);
				done++;
			}
		}),
	);
	return done;
}

async function allNodes(task: string) {
	const out: GraphNode[] = [];
	let after = 0;
	for (let page = 0; page < 1000; page++) {
		const g = await op("graph", (c) => c.graph(task, { after, limit: 1000 }));
		if (!g.ok) throw new Error(`graph ${task}: ${g.code} ${g.message}`);
		out.push(...g.value.nodes);
		if (g.value.next === null) return out;
		after = g.value.next;
	}
	throw new Error(`graph ${task}: more than 1000 pages`);
}

/** A task's eviction log, whole: the ids eviction removed, and how many entries it let go. */
async function evictedIds(task: string): Promise<{
	nodes: Map<string, number>;
	nodeEntries: number;
	dropped: number;
}> {
	/** Each evicted node's last eviction time. */
	const nodes = new Map<string, number>();
	let nodeEntries = 0;
	let after = 0;
	for (let page = 0; page < 1000; page++) {
		const g = await op("evictions", (c) =>
			c.evictions(task, { after, limit: 1000 }),
		);
		if (!g.ok) throw new Error(`evictions ${task}: ${g.code} ${g.message}`);
		for (const e of g.value.evictions)
			if (e.reason === "node_budget") {
				nodes.set(e.id, Math.max(nodes.get(e.id) ?? 0, e.at));
				nodeEntries++;
			}
		if (g.value.next === null)
			return { nodes, nodeEntries, dropped: g.value.dropped };
		after = g.value.next;
	}
	throw new Error(`evictions ${task}: more than 1000 pages`);
}

async function check(): Promise<{ tasks: TaskCheck[]; unchecked: number }> {
	const deadline = now() + CHECK_BUDGET_MS;
	const entries = [...ledger].flatMap(([task, m]) =>
		[...m].map(([id, e]) => ({ task, id, e })),
	);
	const status = new Map<
		string,
		"present" | "missing" | "wrong" | "unreadable"
	>();
	const k = (task: string, id: string) => `${task}/${id}`;
	say(`checking ${entries.length} acknowledged records`);
	const checked = await pool(entries, 16, deadline, async ({ task, id, e }) => {
		const got = await op("result", (c) => c.result(task, id));
		if (got.ok) {
			if (sha(got.value.output) === e.sha) status.set(k(task, id), "present");
			else {
				status.set(k(task, id), "wrong");
				violation("a record read back with another output", {
					request: `GET /v1/tasks/${task}/results/${id}`,
					output: got.value.output.slice(0, 200),
				});
			}
		} else if (got.status === 404 && got.code === "not_found") {
			status.set(k(task, id), "missing");
		} else {
			status.set(k(task, id), "unreadable");
			violation("a record that cannot be read", {
				request: `GET /v1/tasks/${task}/results/${id}`,
				response: `${got.status} ${got.code}: ${got.message}`,
			});
		}
	});

	const results: TaskCheck[] = [];
	for (const task of taskNames) {
		const m = ledger.get(task) ?? new Map<string, LedgerEntry>();
		// Stats after the reads: an eviction that removed a record happened
		// before its read, so it is in these counts.
		const st = await op("stats", (c) => c.stats(task));
		if (!st.ok && m.size > 0)
			throw new Error(`stats ${task}: ${st.code} ${st.message}`);
		const ev = st.ok ? st.value.evictions : {};
		const c: TaskCheck = {
			task,
			ledger: m.size,
			present: 0,
			missing: 0,
			wrong: 0,
			unreadable: 0,
			nodeBudgetEvictions: ev.node_budget?.count ?? 0,
			snapshotBudgetEvictions: ev.snapshot_budget?.count ?? 0,
			orphanEvictions: ev.orphan?.count ?? 0,
			accounted: 0,
			accountedByCount: 0,
			logDropped: 0,
			lost: 0,
			nodes: st.ok ? st.value.nodes : 0,
			snapshots: st.ok ? st.value.snapshots : 0,
			graphNodes: 0,
			graphOrphans: 0,
			missingButInGraph: 0,
			snapshotRefs: 0,
			danglingSnapshots: 0,
		};
		for (const id of m.keys()) {
			const s = status.get(k(task, id));
			if (s === "present") c.present++;
			else if (s === "missing") c.missing++;
			else if (s === "wrong") c.wrong++;
			else if (s === "unreadable") c.unreadable++;
		}
		if (st.ok) {
			// After the reads and the stats, so every eviction that took a
			// record before its read, and every one the stats count, is in it
			// (an alarm may evict more meanwhile: the log may hold more).
			const log = await evictedIds(task);
			c.logDropped = log.dropped;
			if (log.dropped === 0 && log.nodeEntries < c.nodeBudgetEvictions)
				violation("the eviction log and the stats disagree", {
					task,
					logNodeEntries: log.nodeEntries,
					statsNodeEvictions: c.nodeBudgetEvictions,
				});
			// Named, and evicted after its last record was sent (the server's
			// clock and ours are this machine's; a second of slack for the
			// runtime's clock, which stands still within a request).
			const unnamed: string[] = [];
			for (const [id, e] of m) {
				if (status.get(k(task, id)) !== "missing") continue;
				const at = log.nodes.get(id);
				if (at !== undefined && at >= e.sentAt - 1000) c.accounted++;
				else unnamed.push(id);
			}
			c.accountedByCount = Math.min(unnamed.length, log.dropped);
			if (log.dropped === 0)
				for (const id of unnamed)
					violation("a missing record that no eviction took after it", {
						task,
						id,
						sentAt: m.get(id)!.sentAt,
						lastEvictedAt: log.nodes.get(id) ?? null,
					});
		}
		c.lost =
			c.missing - c.accounted - c.accountedByCount + c.wrong + c.unreadable;

		if (st.ok && now() < deadline) {
			// The graph must agree with the results route, hang together, and
			// every snapshot it claims must download with its bytes intact.
			const nodes = await allNodes(task);
			const ids = new Set(nodes.map((n) => n.id));
			c.graphNodes = nodes.length;
			for (const n of nodes)
				if (n.parent !== null && !ids.has(n.parent)) {
					c.graphOrphans++;
					violation("a node whose parent is gone", { task, node: n.id });
				}
			for (const id of m.keys())
				if (status.get(k(task, id)) === "missing" && ids.has(id)) {
					c.missingButInGraph++;
					violation("a record the graph holds and results does not", {
						task,
						id,
					});
				}
			const snaps = nodes.filter((n) => n.snapshot !== null);
			c.snapshotRefs = snaps.length;
			for (const n of snaps) {
				const got = await op("snapshot_get", (cl) =>
					cl.getSnapshot(task, n.id),
				);
				if (got.ok && sameBytes(got.value, snapshotOf(task, n.id))) continue;
				c.danglingSnapshots++;
				violation("a node claims a snapshot that cannot be restored", {
					task,
					node: n.id,
					ref: n.snapshot,
					request: `GET /v1/tasks/${task}/snapshots/${n.id}`,
					response: got.ok
						? `200 with ${got.value.byteLength} other bytes`
						: `${got.status} ${got.code}: ${got.message}`,
				});
			}
		}
		results.push(c);
	}
	return { tasks: results, unchecked: entries.length - checked };
}

// ------------------------------------------------------------------ main

const started = new Date();
const loadBefore = loadavg();
let exitCode = 0;
const cleanup = async () => {
	stopping = true;
	await stack?.stop().catch(() => {});
	rmSync(stateDir, { recursive: true, force: true });
	rmSync(treeDir, { recursive: true, force: true });
	serverLog.end();
};
const onSignal = () => {
	say("\ninterrupted; stopping the stack");
	void cleanup().finally(() => process.exit(130));
};
process.once("SIGINT", onSignal);
process.once("SIGTERM", onSignal);

try {
	say(
		`soak: ${opts.minutes} min, ${opts.tasks} tasks, ${opts.groups} groups ` +
			`of ${opts.groupSize} rollouts, restart every ~${opts.restartEverySec} s, ` +
			`sweep every ${opts.sweepEverySec} s, abort rate ${opts.abortRate}; ` +
			`Worker from a copy of the ${opts.tree === "head" ? "last commit" : "working tree"}`,
	);
	say(`budgets and limits: ${JSON.stringify(VARS)}`);
	const tStart = now();
	stack = await startStack();
	client = makeClient();
	say(
		`stack up in ${now() - tStart} ms at ${stack.url} (state in ${stateDir})`,
	);

	const totalMs = opts.minutes * 60_000;
	const t0 = now();
	const deadline = t0 + totalMs;
	injecting = true;
	phase = "traffic";
	const stopProgress = startProgress(t0, totalMs);
	const faultLoops = Promise.all([restartLoop(deadline), sweepLoop(deadline)]);
	const groups = Array.from({ length: opts.groups }, (_, g) =>
		group(g, deadline),
	);
	await Promise.all(groups).catch((err) => {
		stopping = true;
		throw err;
	});
	const trafficMs = now() - t0;
	stopping = true;
	injecting = false;
	phase = "draining the fault loops";
	await Promise.race([faultLoops, sleep(DRAIN_BUDGET_MS)]);
	stopProgress();

	// One more restart, so the check reads storage, not an isolate's memory.
	say("final restart before the check");
	await restart("graceful");
	const finalRestartMs = restartDowntimesMs.pop()!;
	const requestsBeforeCheck = sum(requests);
	const errorsBeforeCheck = { ...errors };
	const { tasks: perTask, unchecked } = await check();

	// Budgets after a last sweep (the alarm that enforces them does not
	// survive a crash: the sweep is what catches up).
	const swept = await sweepOnce();
	let overBudget = 0;
	let maxNodes = 0;
	for (const task of taskNames) {
		const st = await op("stats", (c) => c.stats(task));
		if (!st.ok) continue;
		maxNodes = Math.max(maxNodes, st.value.nodes);
		if (st.value.nodes > BUDGET_NODES) overBudget++;
	}

	const total = (f: keyof TaskCheck) =>
		perTask.reduce((n, t) => n + (t[f] as number), 0);
	const figures = {
		trafficMs,
		requests: requestsBeforeCheck,
		requestsByOp: { ...requests },
		requestsPerSecond: requestsBeforeCheck / (trafficMs / 1000),
		errors: errorsBeforeCheck,
		faults: {
			restarts: faults.restartsGraceful + faults.restartsKilled,
			...faults,
			restartDowntimeMs: {
				min: Math.min(...restartDowntimesMs),
				max: Math.max(...restartDowntimesMs),
				mean:
					restartDowntimesMs.reduce((a, b) => a + b, 0) /
					Math.max(1, restartDowntimesMs.length),
			},
		},
		events,
		hitRate: events.lookups ? events.hits / events.lookups : 0,
		recordsAcknowledged: events.acks,
		uniqueRecords: total("ledger"),
		recordsChecked: total("ledger") - unchecked,
		unchecked,
		present: total("present"),
		missing: total("missing"),
		evictedAccounted: total("accounted"),
		evictedAccountedByCount: total("accountedByCount"),
		tasksWithLogDropped: perTask.filter((t) => t.logDropped > 0).length,
		wrong: total("wrong"),
		unreadable: total("unreadable"),
		lost: total("lost") + unchecked,
		nodeBudgetEvictions: total("nodeBudgetEvictions"),
		snapshotBudgetEvictions: total("snapshotBudgetEvictions"),
		orphanEvictions: total("orphanEvictions"),
		graphNodes: total("graphNodes"),
		graphOrphans: total("graphOrphans"),
		missingButInGraph: total("missingButInGraph"),
		snapshotRefs: total("snapshotRefs"),
		danglingSnapshots: total("danglingSnapshots"),
		finalRestartMs,
		finalSweep: swept,
		tasksOverNodeBudgetAfterSweep: overBudget,
		maxNodesAfterSweep: maxNodes,
		violations: violationCounts,
	};

	const rows: [string, string][] = [
		["duration (traffic)", `${(trafficMs / 1000).toFixed(0)} s`],
		[
			"requests",
			`${figures.requests} (${figures.requestsPerSecond.toFixed(0)}/s)`,
		],
		...Object.entries(figures.requestsByOp)
			.sort()
			.map(([k2, v]): [string, string] => [`  ${k2}`, String(v)]),
		["failed attempts (retried or expected)", String(sum(errorsBeforeCheck))],
		...Object.entries(errorsBeforeCheck)
			.sort((a, b) => b[1] - a[1])
			.map(([k2, v]): [string, string] => [`  ${k2}`, String(v)]),
		[
			"restarts (SIGTERM / SIGKILL)",
			`${faults.restartsGraceful + faults.restartsKilled} (${faults.restartsGraceful} / ${faults.restartsKilled}), ` +
				`down ${(figures.faults.restartDowntimeMs.mean / 1000).toFixed(1)} s on average`,
		],
		[
			"aborted requests (cut / armed)",
			`${faults.abortsCut} / ${faults.abortsArmed}`,
		],
		["cron sweeps (failed)", `${faults.sweeps} (${faults.sweepFailures})`],
		[
			"rollouts (abandoned)",
			`${events.rollouts} (${events.rolloutsAbandoned})`,
		],
		[
			"lookups: hits / misses",
			`${events.hits} / ${events.misses} (${(100 * figures.hitRate).toFixed(1)}% hits)`,
		],
		[
			"stale cursors / unknown_state fallbacks",
			`${events.staleCursors} / ${events.unknownStateFallbacks}`,
		],
		[
			"snapshots uploaded / restored",
			`${events.snapshotsUploaded} / ${events.restores}`,
		],
		[
			"leases released / left to expire",
			`${events.leasesReleased} / ${events.leasesLeftToExpire}`,
		],
		[
			"evictions: nodes / snapshots / orphan blobs",
			`${figures.nodeBudgetEvictions} / ${figures.snapshotBudgetEvictions} / ${figures.orphanEvictions}`,
		],
		[
			"records acknowledged (with repeats)",
			String(figures.recordsAcknowledged),
		],
		[
			"records checked (unique)",
			`${figures.recordsChecked} of ${figures.uniqueRecords}`,
		],
		["  present, same output", String(figures.present)],
		["  missing, named by the eviction log", String(figures.evictedAccounted)],
		[
			"  missing, held against a log's dropped entries",
			`${figures.evictedAccountedByCount} (tasks whose log dropped entries: ${figures.tasksWithLogDropped})`,
		],
		["  wrong output / unreadable", `${figures.wrong} / ${figures.unreadable}`],
		["LOST", String(figures.lost)],
		[
			"graph: nodes / orphaned / dangling snapshots",
			`${figures.graphNodes} / ${figures.graphOrphans} / ${figures.danglingSnapshots} of ${figures.snapshotRefs}`,
		],
		[
			"tasks over the node budget after a sweep",
			`${overBudget} (max ${maxNodes} nodes, budget ${BUDGET_NODES})`,
		],
		["violations", String(sum(violationCounts))],
		...Object.entries(violationCounts).map(([k2, v]): [string, string] => [
			`  ${k2}`,
			String(v),
		]),
	];
	const w = Math.max(...rows.map(([a]) => a.length));
	console.log(rows.map(([a, b]) => `${a.padEnd(w)}  ${b}`).join("\n"));
	for (const v of violations)
		console.log(`violation: ${v.kind}: ${JSON.stringify(v.detail)}`);
	for (const s of serverErrorSamples.slice(0, 5))
		console.log(`server error: ${JSON.stringify(s)}`);

	const failed = figures.lost > 0 || sum(violationCounts) > 0;
	console.log(
		failed
			? `FAIL: lost ${figures.lost}, violations ${sum(violationCounts)}`
			: "PASS: lost 0, no violations",
	);
	if (failed) exitCode = 1;

	const result = {
		meta: {
			date: started.toISOString(),
			commit: frozen.commit,
			tree: opts.tree,
			// The working tree's changes over the commit, when it ran those.
			uncommitted: frozen.uncommitted,
			diff: frozen.diff,
			node: process.version,
			os: type(),
			cpus: cpus().length,
			cpuModel: cpus()[0]?.model ?? null,
			memoryGiB: Math.round(totalmem() / 2 ** 30),
			loadavgBefore: loadBefore,
			loadavgAfter: loadavg(),
			note: "workerd, wrangler and the soak share this machine's cores",
		},
		options: opts,
		vars: VARS,
		figures,
		perTask,
		violations,
		serverErrorSamples,
		hangs,
		restartDowntimesMs,
	};
	mkdirSync(dirname(opts.out), { recursive: true });
	writeFileSync(opts.out, JSON.stringify(result, null, "\t") + "\n");
	say(`wrote ${opts.out}; the Worker's log is in ${opts.serverLog}`);
} catch (err) {
	say(`the soak failed: ${err instanceof Error ? err.stack : err}`);
	exitCode = 2;
} finally {
	await cleanup();
}
process.exit(exitCode);
