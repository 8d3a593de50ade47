/**
 * An open-loop HTTP load generator.
 *
 * Why not autocannon (or k6's default executors, or `ab`): they are closed
 * loop. Each connection sends its next request only when the previous one has
 * answered, so when the server stalls the generator stalls with it and the
 * requests that *should* have been sent during the stall are never measured.
 * That is coordinated omission, and it hides exactly the tail we care about.
 * wrk2 fixes it with a constant-throughput schedule, but wrk2 is not available
 * on this machine, so this module does what wrk2 does:
 *
 * - request i has an intended send time `t0 + i / rate`, fixed before the run
 *   starts, and it is sent at (or as soon as possible after) that time whether
 *   or not earlier requests have answered;
 * - its latency is `completion time - intended send time`, so time spent
 *   waiting in the generator (a late timer, a busy event loop, a request
 *   queued in undici behind busy connections) counts against the server, as
 *   it would for a real client that wanted to send at that moment;
 * - how late the generator itself was is reported separately (`lateSends`,
 *   `maxSendLagMs`), so a run where the client was the bottleneck can be told
 *   apart from one where the server was.
 *
 * Everything is bounded: the number of requests is fixed by rate and
 * duration, requests in flight are capped (over the cap a request is counted
 * as dropped, not queued without end), stragglers get a bounded drain time and
 * are then aborted and counted as errors.
 *
 * Latencies go into an HDR histogram in microseconds (3 significant digits).
 */
import { cpus } from "node:os";
import { performance } from "node:perf_hooks";
import { SingleBar } from "cli-progress";
import * as hdr from "hdr-histogram-js";
import { Pool } from "undici";

export type IncomingHeaders = Record<string, string | string[] | undefined>;

/** One request, as built by the factory. */
export interface RequestSpec {
	method: "GET" | "POST" | "PUT" | "DELETE";
	path: string;
	headers?: Record<string, string>;
	/** Prebuilt when possible: serializing in the send path costs client CPU. */
	body?: string | Buffer;
	/**
	 * Checks a 2xx response; returns null when it is right, else a reason. A
	 * failed check counts as an error (a lookup that misses, say). It runs
	 * after the latency is taken but on the generator's one thread, so a
	 * slow check makes later sends late: keep it cheap.
	 */
	check?: (body: string, headers: IncomingHeaders) => string | null;
}

export interface LoadOptions {
	/** Label for progress output and results. */
	name: string;
	/** Origin to send to, e.g. `http://127.0.0.1:8787`. */
	origin: string;
	/** Target rate, requests per second. */
	rate: number;
	/** Measured phase, in milliseconds. */
	durationMs: number;
	/** Unrecorded phase before it at the same rate (connections, JIT, caches). */
	warmupMs?: number;
	/** Builds request i (0-based over warm-up and measured phase together). */
	request: (i: number) => RequestSpec;
	/** Pool size; default min(256, max(8, rate / 8)). */
	connections?: number;
	/** Cap on requests in flight; over it a request is dropped (an error). */
	maxInFlight?: number;
	/** Time allowed after the last send for stragglers; then they are aborted. */
	drainMs?: number;
	/** Per-request timeout for headers and for the body. */
	timeoutMs?: number;
	/** A send later than this after its intended time counts as late. */
	lagThresholdMs?: number;
	/** "auto": a bar on a TTY, a counter line every 5 s otherwise. */
	progress?: boolean | "auto";
}

export interface LatencySummary {
	/** All in microseconds. */
	p50: number;
	p90: number;
	p95: number;
	p99: number;
	p999: number;
	max: number;
	mean: number;
	count: number;
}

export type ErrorKind =
	"status" | "check" | "network" | "timeout" | "unfinished" | "dropped";

export interface LoadResult {
	name: string;
	targetRate: number;
	durationMs: number;
	warmupMs: number;
	connections: number;
	/** Measured-phase requests scheduled. */
	scheduled: number;
	/** Measured-phase requests that got a response (any status). */
	completed: number;
	/** Responses that were 2xx and passed the check. */
	ok: number;
	errors: number;
	errorKinds: Record<ErrorKind, number>;
	/** A few error messages, for the report. */
	errorSamples: string[];
	warmupErrors: number;
	/** completed / (measured window, stretched to the last completion). */
	achievedRate: number;
	/** Latency of the ok responses, from intended send time. */
	latencyUs: LatencySummary;
	/** Sends that left more than lagThresholdMs after their intended time. */
	lateSends: number;
	maxSendLagMs: number;
	/** True when the generator could not keep its own schedule. */
	behind: boolean;
	/**
	 * Worst latency (ms) of the ok responses per 100 ms of intended send
	 * time: periodic stalls (a timer, a flush, GC) show up as a pattern here
	 * that percentiles flatten away.
	 */
	timelineMaxMs: number[];
	/** Requests that got a response, warm-up included: the work the server did. */
	answeredTotal: number;
	/** Wall time of the whole run: warm-up, measured phase and drain. */
	wallMs: number;
	/** Generator process CPU over the run, as a fraction of one core. */
	generatorCpu: number;
	/** All cores busy over the run, as a fraction of the whole machine. */
	machineCpu: number;
}

const ERROR_KINDS: ErrorKind[] = [
	"status",
	"check",
	"network",
	"timeout",
	"unfinished",
	"dropped",
];

export function newHistogram(): hdr.Histogram {
	// 1 µs to 60 s at 3 significant digits; autoResize keeps a freak outlier
	// from throwing instead of being recorded.
	return hdr.build({
		lowestDiscernibleValue: 1,
		highestTrackableValue: 60_000_000,
		numberOfSignificantValueDigits: 3,
		autoResize: true,
	});
}

export function summarize(h: hdr.Histogram): LatencySummary {
	const empty = h.totalCount === 0;
	// A percentile reads as the top of its bucket, which can be a hair above
	// the exact maximum; clamp so that p99 never reads larger than max.
	const at = (p: number) =>
		empty ? 0 : Math.min(h.getValueAtPercentile(p), h.maxValue);
	return {
		p50: at(50),
		p90: at(90),
		p95: at(95),
		p99: at(99),
		p999: at(99.9),
		max: empty ? 0 : h.maxValue,
		mean: empty ? 0 : Math.round(h.mean),
		count: h.totalCount,
	};
}

const TIMELINE_MS = 100;

/**
 * A stall: consecutive windows of the timeline (`timelineMaxMs`) whose worst
 * latency reached a threshold. One server pause of d ms shows as one stall
 * peaking near d ms; percentiles spread it over thousands of requests.
 */
export interface Stall {
	/** When its first window began, in seconds into the measured phase. */
	atS: number;
	/** How many windows of TIMELINE_MS it spans. */
	windows: number;
	/** Its worst latency, ms. */
	peakMs: number;
}

/** The stalls of a run's timeline: runs of windows at or over `atLeastMs`. */
export function stallsOf(timelineMaxMs: number[], atLeastMs = 100): Stall[] {
	const out: Stall[] = [];
	let open: Stall | null = null;
	for (const [i, v] of timelineMaxMs.entries()) {
		if (v < atLeastMs) {
			open = null;
			continue;
		}
		if (open === null) {
			open = { atS: (i * TIMELINE_MS) / 1000, windows: 0, peakMs: 0 };
			out.push(open);
		}
		open.windows++;
		open.peakMs = Math.max(open.peakMs, v);
	}
	return out;
}

/** Milliseconds since an arbitrary origin, sub-ms resolution. */
const now = () => performance.now();

/** Records a latency in µs; HDR needs a positive integer. */
export function recordMs(h: hdr.Histogram, ms: number): void {
	h.recordValue(Math.max(1, Math.round(ms * 1000)));
}

/** Machine-wide CPU ticks, to see whether the box itself is saturated. */
export function cpuTicks(): { busy: number; total: number } {
	let busy = 0;
	let total = 0;
	for (const c of cpus()) {
		const t = c.times;
		const all = t.user + t.nice + t.sys + t.idle + t.irq;
		total += all;
		busy += all - t.idle;
	}
	return { busy, total };
}

function isTimeout(err: unknown): boolean {
	const code = (err as { code?: string } | null)?.code ?? "";
	return (
		code === "UND_ERR_HEADERS_TIMEOUT" ||
		code === "UND_ERR_BODY_TIMEOUT" ||
		code === "UND_ERR_CONNECT_TIMEOUT"
	);
}

function errorMessage(err: unknown): string {
	if (err instanceof Error) {
		const code = (err as { code?: string }).code;
		return code ? `${code}: ${err.message}` : err.message;
	}
	return String(err);
}

/**
 * Runs one open-loop load phase and resolves with its figures. Never rejects
 * for request failures (they are counted); rejects only on bad options.
 */
export async function runLoad(opts: LoadOptions): Promise<LoadResult> {
	const rate = opts.rate;
	if (!(rate > 0) || !(opts.durationMs > 0)) {
		throw new RangeError("rate and durationMs must be positive");
	}
	const warmupMs = opts.warmupMs ?? 0;
	const connections =
		opts.connections ?? Math.min(256, Math.max(8, Math.ceil(rate / 8)));
	// A few seconds' worth of requests: past that the server is not keeping
	// up and queueing more only grows memory without telling us anything new.
	const maxInFlight = opts.maxInFlight ?? Math.max(1000, Math.ceil(rate * 5));
	const drainMs = opts.drainMs ?? 5000;
	const timeoutMs = opts.timeoutMs ?? 10_000;
	const lagThresholdMs = opts.lagThresholdMs ?? 10;
	const intervalMs = 1000 / rate;
	const warmupCount = Math.floor((warmupMs / 1000) * rate);
	const measuredCount = Math.floor((opts.durationMs / 1000) * rate);
	const total = warmupCount + measuredCount;

	const pool = new Pool(opts.origin, {
		connections,
		pipelining: 1,
		// workerd closes a connection idle for 5 s and sends no Keep-Alive
		// hint; a client that keeps it longer sends into that close now and
		// then and reads a reset (ECONNRESET, "other side closed"). A pool
		// sized for peak rate has idle connections at every rate.
		keepAliveTimeout: 2_000,
		keepAliveMaxTimeout: 2_000,
		headersTimeout: timeoutMs,
		bodyTimeout: timeoutMs,
		connect: { timeout: Math.min(timeoutMs, 5000) },
	});
	// Set when the drain time is up; the pool is then destroyed, which fails
	// every request still in flight. Cheaper than an AbortSignal per request.
	let cutOff = false;
	const hist = newHistogram();
	const errorKinds = Object.fromEntries(
		ERROR_KINDS.map((k) => [k, 0]),
	) as Record<ErrorKind, number>;
	const errorSamples: string[] = [];
	let warmupErrors = 0;
	let completed = 0;
	let ok = 0;
	let lateSends = 0;
	let maxSendLagMs = 0;
	let inFlight = 0;
	let sent = 0;
	let lastCompletion = 0;
	let answered = 0;
	const pending = new Set<Promise<void>>();
	const timeline = new Array<number>(
		Math.ceil(opts.durationMs / TIMELINE_MS),
	).fill(0);

	const fail = (measured: boolean, kind: ErrorKind, why: string) => {
		if (!measured) {
			warmupErrors++;
			return;
		}
		errorKinds[kind]++;
		if (errorSamples.length < 5) errorSamples.push(`${kind}: ${why}`);
	};

	const progress = startProgress(opts, total);

	// Starts a little in the future so the first requests are not already late.
	const t0 = now() + 20;
	const measureStart = t0 + warmupCount * intervalMs;
	const cpu0 = process.cpuUsage();
	const ticks0 = cpuTicks();
	const wall0 = now();

	const fire = (i: number, intended: number) => {
		const measured = i >= warmupCount;
		const lag = now() - intended;
		if (measured) {
			if (lag > lagThresholdMs) lateSends++;
			if (lag > maxSendLagMs) maxSendLagMs = lag;
		}
		if (inFlight >= maxInFlight) {
			fail(measured, "dropped", `over ${maxInFlight} in flight`);
			return;
		}
		let spec: RequestSpec;
		try {
			spec = opts.request(i);
		} catch (err) {
			fail(measured, "check", `request factory: ${errorMessage(err)}`);
			return;
		}
		inFlight++;
		sent++;
		const p = send(spec, measured, intended).finally(() => {
			inFlight--;
			pending.delete(p);
		});
		pending.add(p);
	};

	const send = async (
		spec: RequestSpec,
		measured: boolean,
		intended: number,
	): Promise<void> => {
		try {
			const res = await pool.request({
				method: spec.method,
				path: spec.path,
				headers: spec.body
					? { "content-type": "application/json", ...spec.headers }
					: spec.headers,
				body: spec.body,
			});
			// The whole body is part of the latency: a hit is only useful once
			// its output has arrived.
			const text = await res.body.text();
			const done = now();
			answered++;
			if (!measured) {
				if (res.statusCode < 200 || res.statusCode > 299) warmupErrors++;
				return;
			}
			completed++;
			lastCompletion = Math.max(lastCompletion, done);
			if (res.statusCode < 200 || res.statusCode > 299) {
				fail(true, "status", `${res.statusCode} ${text.slice(0, 200)}`);
				return;
			}
			const why = spec.check ? spec.check(text, res.headers) : null;
			if (why !== null) {
				fail(true, "check", why);
				return;
			}
			ok++;
			recordMs(hist, done - intended);
			const slot = Math.floor((intended - measureStart) / TIMELINE_MS);
			if (slot >= 0 && slot < timeline.length) {
				timeline[slot] = Math.max(timeline[slot], done - intended);
			}
		} catch (err) {
			if (cutOff) {
				fail(measured, "unfinished", `no answer within ${drainMs} ms`);
			} else if (isTimeout(err)) {
				fail(measured, "timeout", errorMessage(err));
			} else {
				fail(measured, "network", errorMessage(err));
			}
		}
	};

	// The scheduler: wake up, send everything that is due, sleep until the
	// next one is. Batches are capped so that, when behind, responses still
	// get processed between batches; the intended times stay fixed, so
	// catching up late is charged to latency, not hidden.
	await new Promise<void>((resolve) => {
		let next = 0;
		const tick = () => {
			const t = now();
			let batch = 0;
			while (next < total && t0 + next * intervalMs <= t && batch < 256) {
				fire(next, t0 + next * intervalMs);
				next++;
				batch++;
			}
			progress.update(sent, inFlight, errorCount());
			if (next >= total) {
				resolve();
				return;
			}
			const wait = t0 + next * intervalMs - now();
			if (wait <= 0) setImmediate(tick);
			else setTimeout(tick, Math.max(0, Math.floor(wait)));
		};
		setTimeout(tick, Math.max(0, Math.floor(t0 - now())));
	});

	function errorCount(): number {
		let n = 0;
		for (const k of ERROR_KINDS) n += errorKinds[k];
		return n;
	}

	// Bounded drain: wait for stragglers, then abort what is left (counted
	// as "unfinished" by the catch above).
	if (pending.size > 0) {
		let timer: NodeJS.Timeout | undefined;
		const drained = Promise.all([...pending]).then(() => undefined);
		const tick = setInterval(
			() => progress.update(sent, inFlight, errorCount()),
			250,
		);
		await Promise.race([
			drained,
			new Promise<void>((r) => (timer = setTimeout(r, drainMs))),
		]);
		clearTimeout(timer);
		clearInterval(tick);
		if (pending.size > 0) {
			cutOff = true;
			void pool.destroy().catch(() => undefined);
			// Destroyed requests settle promptly; bound it anyway.
			await Promise.race([
				Promise.all([...pending]),
				new Promise((r) => setTimeout(r, 2000)),
			]);
		}
	}
	const cpu = process.cpuUsage(cpu0);
	const ticks1 = cpuTicks();
	const wall = now() - wall0;
	progress.stop(sent, inFlight, errorCount());
	await pool.destroy().catch(() => undefined);

	// Requests never sent because the pool was over the cap are counted
	// as dropped above; anything else missing from `completed` is an error
	// already. The window is stretched to the last completion so a server
	// that falls behind shows an achieved rate below the target.
	const windowMs = Math.max(
		opts.durationMs,
		lastCompletion > 0 ? lastCompletion - measureStart : 0,
	);
	const errors = errorCount();
	return {
		name: opts.name,
		targetRate: rate,
		durationMs: opts.durationMs,
		warmupMs,
		connections,
		scheduled: measuredCount,
		completed,
		ok,
		errors,
		errorKinds,
		errorSamples,
		warmupErrors,
		achievedRate: completed / (windowMs / 1000),
		latencyUs: summarize(hist),
		lateSends,
		maxSendLagMs: Math.round(maxSendLagMs * 10) / 10,
		behind: lateSends > 0,
		timelineMaxMs: timeline.map((v) => Math.round(v * 10) / 10),
		answeredTotal: answered,
		wallMs: Math.round(wall),
		generatorCpu: (cpu.user + cpu.system) / 1000 / wall,
		machineCpu:
			ticks1.total > ticks0.total
				? (ticks1.busy - ticks0.busy) / (ticks1.total - ticks0.total)
				: 0,
	};
}

interface Progress {
	update(sent: number, inFlight: number, errors: number): void;
	stop(sent: number, inFlight: number, errors: number): void;
}

/** A bar on a TTY; on a pipe, a counter line every 5 s so logs stay short. */
export function startProgress(
	opts: Pick<LoadOptions, "name" | "progress">,
	total: number,
): Progress {
	const mode = opts.progress ?? "auto";
	if (mode === false) return { update() {}, stop() {} };
	if (process.stderr.isTTY) {
		const bar = new SingleBar({
			format:
				`${opts.name.padEnd(24)} {bar} {value}/{total} sent` +
				" | {inFlight} in flight | {errors} errors",
			barsize: 24,
			stream: process.stderr,
			hideCursor: true,
			clearOnComplete: true,
		});
		bar.start(total, 0, { inFlight: 0, errors: 0 });
		return {
			update: (sent, inFlight, errors) =>
				bar.update(sent, { inFlight, errors }),
			stop: (sent, inFlight, errors) => {
				bar.update(sent, { inFlight, errors });
				bar.stop();
			},
		};
	}
	let last = now();
	return {
		update(sent, inFlight, errors) {
			if (now() - last < 5000) return;
			last = now();
			process.stderr.write(
				`${opts.name}: ${sent}/${total} sent, ${inFlight} in flight, ` +
					`${errors} errors\n`,
			);
		},
		stop() {},
	};
}

/** Microseconds as milliseconds with two decimals, for tables. */
export function ms(us: number): string {
	return (us / 1000).toFixed(2);
}
