/**
 * The container host: a Node service that runs sandboxes for the Worker.
 *
 * It registers with the Worker (`POST /v1/hosts` with a `host` key), gets
 * back an id and an HMAC secret, and heartbeats. Every request the Worker
 * then sends it is signed with that secret (`core/signing.ts`); the host
 * refuses anything unsigned, wrongly signed, stale or replayed before it
 * reads the body. The routes and bodies are `core/host-api.ts`'s.
 *
 * Snapshot bytes never pass through the Worker's request to the host: the
 * host uploads a snapshot to the Worker's blob route itself, and downloads
 * the blob it is asked to restore, both with its own key.
 */
import { randomBytes } from "node:crypto";
import { mkdir, mkdtemp, rm } from "node:fs/promises";
import type { Server } from "node:http";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";
import { createAdaptorServer } from "@hono/node-server";
import { Hono, type Context } from "hono";
import { bodyLimit } from "hono/body-limit";
import { HTTPException } from "hono/http-exception";
import type { ContentfulStatusCode } from "hono/utils/http-status";
import { z } from "zod";
import { TrellisClient, TrellisError } from "../client/http.ts";
import type {
	Sandbox,
	SandboxFactory,
	SnapshotSource,
} from "../client/sandbox.ts";
import {
	BlobSource,
	ExecRequest,
	SnapshotRequest,
	StartSandboxRequest,
	WarmRequest,
	type Driver,
	type ExecResponse,
	type ForkResponse,
	type HeartbeatRequest,
	type HostHealth,
	type RegisterHostRequest,
	type RegisterHostResponse,
	type SnapshotResponse,
	type StartSandboxResponse,
	type Template,
} from "../core/host-api.ts";
import { firstIssue } from "../core/api.ts";
import { verify } from "../core/signing.ts";
import { WarmPool, type PoolSpec } from "./pool.ts";
import {
	UnknownTemplateError,
	loadDrivers,
	type DriverConfig,
	type DriverLoader,
	type HostDriver,
} from "./registry.ts";

/** Options of {@link createHost}. */
export interface HostOptions {
	/** The Worker's origin, e.g. `http://127.0.0.1:8787`. */
	worker: string;
	/** An API key with role `host`, for registering and for snapshot blobs. */
	key: string;
	/** The port to listen on (default 0: a free port). */
	port?: number;
	/** The address to listen on (default `127.0.0.1`). */
	hostname?: string;
	/**
	 * The URL the Worker reaches this host at, when it is not the address
	 * listened on (behind a proxy, in a container).
	 */
	publicUrl?: string;
	/** A name shown in the Worker's host list. */
	name?: string;
	/** Sandboxes run at once (default 16); a start or fork beyond it gets 429. */
	capacity?: number;
	/** The drivers to offer (default all that can run here; workspace always can). */
	drivers?: readonly Driver[];
	/** Driver loaders that replace the built-in ones of their names. */
	loaders?: Partial<Record<Driver, DriverLoader>>;
	/** What templates mean, per driver (seed dirs, images, databases). */
	templates?: Pick<DriverConfig, "workspace" | "docker" | "sqlite">;
	/** Where sandboxes live (default: a new directory under the system temp dir). */
	dataDir?: string;
	/** Warm pools to fill at start: ready copies of a template's root. */
	pools?: readonly { template: Template; count: number }[];
	/**
	 * The most sandboxes the warm pools hold, ready or being made, on top
	 * of `capacity` (default: `capacity`). Pooled sandboxes sit idle until
	 * a start takes one, which then counts against `capacity`.
	 */
	poolCapacity?: number;
	/** A sandbox unused this long is stopped as leaked (default 10 min). */
	idleMs?: number;
	/** A call's time limit when its request gives none (default 60 s). */
	execTimeoutMs?: number;
	/** A call's output cap when its request gives none (default 1 MiB). */
	maxOutputBytes?: number;
	/**
	 * The most output a driver buffers for one call (default 16 MiB); a
	 * request asking for more gets this much.
	 */
	outputCeilingBytes?: number;
	/** The clock signatures and idle times are read from (default `Date.now`). */
	clock?: () => number;
	/** Registration attempts before `start()` gives up (default 5). */
	registerAttempts?: number;
	/** The `fetch` the host reaches the Worker with (a proxy agent, a tracer). */
	fetch?: typeof fetch;
	/** Where the host logs (default: stderr). */
	log?: (message: string) => void;
}

/** A running (or ready to run) container host. */
export interface Host {
	/** The Hono app, for tests that call it without a socket. */
	readonly app: Hono<HostEnv>;
	/** Listens, loads the drivers, registers and starts heartbeating. */
	start(): Promise<{ url: string; id: string }>;
	/** Stops every sandbox, the heartbeat and the server. Idempotent. */
	stop(): Promise<void>;
	/** The id the Worker gave at the last registration (null before). */
	readonly id: string | null;
	/** Where the Worker reaches the host (null before `start`). */
	readonly url: string | null;
	/** The drivers that loaded, once started. */
	readonly drivers: readonly Driver[];
	/** Sends one heartbeat now (re-registering on 404); the timer calls it too. */
	heartbeat(): Promise<void>;
	/** Stops sandboxes idle longer than `idleMs` now; returns their ids. */
	sweepIdle(): Promise<string[]>;
	/** What `GET /health` answers. */
	health(): HostHealth & { poolHits: number; poolMisses: number };
}

/** Hono's environment for the host app. */
export type HostEnv = {
	Variables: {
		/** The exact bytes the signature covered; handlers parse these. */
		body: Uint8Array;
	};
};

/** One live sandbox and what the server tracks about it. */
interface Live {
	id: string;
	driver: HostDriver;
	template: Template;
	sandbox: Sandbox;
	/** Clock time of the end of the last operation (or the start). */
	lastUsed: number;
	/** Operations in flight. */
	busy: number;
	/** Operations on one sandbox run one at a time, in arrival order. */
	queue: Promise<unknown>;
}

/** A body of a signed request is small JSON; snapshots never come this way. */
const MAX_BODY_BYTES = 2 << 20;
/** `POST /sandboxes/:id/fork` takes no options: an empty body or `{}`. */
const ForkBody = z.object({}).strict();
/** Start latencies kept per source for the p50. */
const LATENCY_SAMPLES = 1024;
/**
 * How long after a call's time limit the server waits for a driver that
 * enforces the limit itself before it gives the sandbox up.
 */
const TIMEOUT_GRACE_MS = 5000;

/** An error the API answers with `{error: {code, message}}`. */
function hostError(
	status: ContentfulStatusCode,
	code: string,
	message: string,
	headers?: Record<string, string>,
): HTTPException {
	return new HTTPException(status, {
		res: Response.json({ error: { code, message } }, { status, headers }),
	});
}

const REFUSALS = {
	unsigned: "sign the request (x-trellis-timestamp, -nonce, -signature)",
	bad_signature: "the signature does not match the request",
	stale: "the request's timestamp is too far from the host's clock",
	replayed: "this nonce was used already",
} as const;

/** A body, parsed from the signed bytes and validated; 400 otherwise. */
function parse<T extends z.ZodType>(
	c: Context<HostEnv>,
	schema: T,
	empty?: unknown,
): z.infer<T> {
	const bytes = c.get("body");
	let json: unknown = empty;
	if (bytes.length > 0 || empty === undefined) {
		try {
			json = JSON.parse(
				new TextDecoder("utf-8", { fatal: true }).decode(bytes),
			);
		} catch {
			throw hostError(400, "invalid_json", "the body is not valid JSON");
		}
	}
	const r = schema.safeParse(json);
	if (!r.success) throw hostError(400, "invalid_request", firstIssue(r.error));
	return r.data;
}

/** Whether a ref's key is a blob the Worker stores (its upload route's keys). */
export function isBlobKey(key: string): boolean {
	return key.startsWith("snapshots/");
}

function p50(samples: number[]): number {
	if (samples.length === 0) return 0;
	const sorted = [...samples].sort((a, b) => a - b);
	return sorted[Math.floor((sorted.length - 1) / 2)];
}

function poolKey(template: Template, restore?: BlobSource): string {
	const base = `${template.driver}:${template.name ?? ""}${template.network === true ? "+net" : ""}`;
	return restore ? `${base}@${restore.task}/${restore.state}` : base;
}

/** Download failures, told apart from a driver's failure to restore. */
class DownloadError extends Error {
	override readonly name = "DownloadError";
	constructor(readonly cause: TrellisError) {
		super(cause.message);
	}
}

/**
 * Creates a container host. Nothing runs until `start()`.
 *
 * ```ts
 * const host = createHost({ worker: "http://127.0.0.1:8787", key });
 * const { url, id } = await host.start();
 * ```
 */
export function createHost(options: HostOptions): Host {
	const clock = options.clock ?? Date.now;
	const capacity = options.capacity ?? 16;
	const idleMs = options.idleMs ?? 10 * 60_000;
	const execTimeoutMs = options.execTimeoutMs ?? 60_000;
	const defaultCap = options.maxOutputBytes ?? 1 << 20;
	const ceiling = Math.max(options.outputCeilingBytes ?? 16 << 20, defaultCap);
	const log =
		options.log ?? ((m: string) => process.stderr.write(`[host] ${m}\n`));
	const fetchWorker = options.fetch ?? globalThis.fetch.bind(globalThis);
	const worker = new TrellisClient({
		url: options.worker,
		key: options.key,
		fetch: fetchWorker,
	});

	let drivers = new Map<Driver, HostDriver>();
	const sandboxes = new Map<string, Live>();
	/** Starts and forks under way, counted against capacity before they finish. */
	let reserved = 0;
	/** Fork latencies; the pool keeps those of starts, restores and its own hits. */
	const forks: number[] = [];
	const pool = new WarmPool({
		maxTotal: options.poolCapacity ?? capacity,
		onError: (key, err) =>
			log(`warm pool ${key}: ${(err as Error).message ?? err}`),
	});

	let registration: RegisterHostResponse | null = null;
	let url: string | null = null;
	let server: Server | null = null;
	let dataDir: string | null = null;
	let ownsDataDir = false;
	let heartbeatTimer: NodeJS.Timeout | null = null;
	let sweepTimer: NodeJS.Timeout | null = null;
	let beating: Promise<void> | null = null;
	let stopping: Promise<void> | null = null;
	/** Nonces seen inside the skew window, for replay refusal. */
	const seen = new Map<string, number>();

	// --------------------------------------------------------- sandboxes

	function live(id: string): Live {
		const entry = sandboxes.get(id);
		if (!entry)
			throw hostError(404, "sandbox_not_found", `no sandbox ${id} here`);
		return entry;
	}

	/** Takes a capacity slot for a sandbox about to exist; 429 when full. */
	function reserve(): () => void {
		if (sandboxes.size + reserved >= capacity)
			throw hostError(
				429,
				"at_capacity",
				`this host runs at most ${capacity} sandboxes`,
				{ "retry-after": "1" },
			);
		reserved++;
		let released = false;
		return () => {
			if (!released) reserved--;
			released = true;
		};
	}

	function adopt(driver: HostDriver, template: Template, sandbox: Sandbox) {
		const id = `sb_${randomBytes(12).toString("hex")}`;
		sandboxes.set(id, {
			id,
			driver,
			template,
			sandbox,
			lastUsed: clock(),
			busy: 0,
			queue: Promise.resolve(),
		});
		return id;
	}

	/** Runs `fn` on a sandbox after the operations before it; counts it busy. */
	function serially<T>(entry: Live, fn: () => Promise<T>): Promise<T> {
		entry.busy++;
		// A sandbox stopped while this operation waited its turn is gone.
		const guarded = () => {
			if (sandboxes.get(entry.id) !== entry)
				throw hostError(
					404,
					"sandbox_not_found",
					`no sandbox ${entry.id} here`,
				);
			return fn();
		};
		const run = entry.queue.then(guarded, guarded).finally(() => {
			entry.busy--;
			entry.lastUsed = clock();
		});
		entry.queue = run.catch(() => undefined);
		return run;
	}

	async function remove(entry: Live): Promise<void> {
		if (sandboxes.get(entry.id) !== entry) return;
		sandboxes.delete(entry.id);
		try {
			await entry.sandbox.stop();
		} catch (err) {
			log(`stopping ${entry.id} failed: ${(err as Error).message}`);
		}
	}

	function driverFor(template: Template): {
		driver: HostDriver;
		factory: SandboxFactory;
	} {
		const driver = drivers.get(template.driver);
		if (!driver)
			throw hostError(
				400,
				"driver_unavailable",
				`this host does not run ${template.driver} sandboxes`,
			);
		try {
			return { driver, factory: driver.factory(template) };
		} catch (err) {
			if (err instanceof UnknownTemplateError)
				throw hostError(400, "unknown_template", err.message);
			throw err;
		}
	}

	function sourceOf(blob: BlobSource): SnapshotSource {
		return {
			ref: blob.ref,
			read: async () => {
				if (!isBlobKey(blob.ref.key))
					throw new Error(
						`${blob.ref.key} is a ${blob.ref.driver} handle, not a blob`,
					);
				try {
					return await worker.getSnapshot(blob.task, blob.state);
				} catch (err) {
					if (err instanceof TrellisError) throw new DownloadError(err);
					throw err;
				}
			},
		};
	}

	/** How a pool key makes its sandboxes: the template's root, or a snapshot's copies. */
	function poolSpec(factory: SandboxFactory, restore?: BlobSource): PoolSpec {
		if (!restore) return { kind: "root", factory };
		// One restore, then forks of it: a fork is cheaper than a restore.
		return { kind: "fork", parent: () => factory.restore(sourceOf(restore)) };
	}

	function health(): HostHealth & { poolHits: number; poolMisses: number } {
		const stats = pool.stats();
		let busy = 0;
		for (const s of sandboxes.values()) if (s.busy > 0) busy++;
		return {
			drivers: [...drivers.keys()],
			capacity,
			sandboxes: sandboxes.size,
			busy,
			pools: stats.pools,
			// Starts that found a warm sandbox, and those that did not.
			poolHits: stats.hits,
			poolMisses: stats.misses,
			starts: {
				...stats.starts,
				...(forks.length > 0 && {
					fork: { count: forks.length, p50Ms: p50(forks) },
				}),
			},
		};
	}

	async function sweepIdle(): Promise<string[]> {
		const cutoff = clock() - idleMs;
		const idle = [...sandboxes.values()].filter(
			(s) => s.busy === 0 && s.lastUsed < cutoff,
		);
		for (const s of idle) log(`stopping ${s.id}: idle over ${idleMs} ms`);
		await Promise.all(idle.map(remove));
		return idle.map((s) => s.id);
	}

	// --------------------------------------------------------------- app

	const app = new Hono<HostEnv>();

	app.onError((err, c) => {
		if (err instanceof HTTPException) {
			const res = err.getResponse();
			if (res.headers.get("content-type")?.includes("application/json"))
				return res;
			return c.json(
				{
					error: {
						code: err.status === 413 ? "too_large" : "invalid_request",
						message: err.message || "request refused",
					},
				},
				err.status,
			);
		}
		log(`unhandled error: ${(err as Error).stack ?? err}`);
		return c.json(
			{ error: { code: "internal", message: "internal error" } },
			500,
		);
	});
	app.notFound((c) =>
		c.json(
			{
				error: {
					code: "not_found",
					message: `no route for ${c.req.method} ${c.req.path}`,
				},
			},
			404,
		),
	);

	app.use(
		"*",
		bodyLimit({
			maxSize: MAX_BODY_BYTES,
			onError: () => {
				throw hostError(
					413,
					"too_large",
					`a request body may be at most ${MAX_BODY_BYTES} bytes`,
				);
			},
		}),
	);

	// Every route, unknown ones too: nothing is answered before the
	// signature checks out, and a refused request touches nothing.
	app.use("*", async (c, next) => {
		if (!registration)
			throw hostError(
				503,
				"not_registered",
				"the host has not registered with the Worker yet",
			);
		const body = new Uint8Array(await c.req.arrayBuffer());
		const target = new URL(c.req.url);
		const verdict = verify(
			registration.secret,
			c.req.method,
			target.pathname + target.search,
			body,
			c.req.raw.headers,
			clock(),
			seen,
		);
		if (!verdict.ok) throw hostError(401, verdict.code, REFUSALS[verdict.code]);
		c.set("body", body);
		await next();
	});

	app.get("/health", (c) => c.json(health()));

	app.post("/sandboxes", async (c) => {
		const req = parse(c, StartSandboxRequest);
		const { driver, factory } = driverFor(req.template);
		if (req.restore && req.restore.ref.driver !== req.template.driver)
			throw hostError(
				400,
				"driver_mismatch",
				`a ${req.restore.ref.driver} snapshot cannot start a ${req.template.driver} sandbox`,
			);
		const release = reserve();
		const started = performance.now();
		let sandbox: Sandbox;
		let source: StartSandboxResponse["source"];
		try {
			// A warm copy of the same template, or of the same snapshot.
			const ready = pool.take(poolKey(req.template, req.restore));
			if (ready) {
				sandbox = ready;
				source = "pool";
			} else {
				sandbox = req.restore
					? await factory.restore(sourceOf(req.restore))
					: await factory.start();
				source = req.restore ? "restore" : "fresh";
				pool.record(source, performance.now() - started);
			}
		} catch (err) {
			if (err instanceof DownloadError)
				throw err.cause.status === 404
					? hostError(404, "snapshot_not_found", err.message)
					: hostError(502, "worker_error", err.message);
			if (req.restore)
				throw hostError(
					422,
					"restore_failed",
					`restoring ${req.restore.ref.key} failed: ${(err as Error).message}`,
				);
			throw err;
		} finally {
			release();
		}
		const startMs = performance.now() - started;
		const id = adopt(driver, req.template, sandbox);
		return c.json({ id, source, startMs } satisfies StartSandboxResponse, 201);
	});

	app.post("/sandboxes/:id/exec", async (c) => {
		const entry = live(c.req.param("id"));
		const req = parse(c, ExecRequest);
		const timeoutMs = req.timeoutMs ?? execTimeoutMs;
		const cap = Math.min(req.maxOutputBytes ?? defaultCap, ceiling);
		const mutates = req.call.mutates ?? entry.sandbox.mutates(req.call);
		const started = performance.now();
		const result = await serially(entry, async () => {
			// The drivers stop a command at its limit themselves; this timer
			// is the backstop for one that hangs anyway.
			let timer: NodeJS.Timeout | undefined;
			const overran = new Promise<"overran">((resolve) => {
				timer = setTimeout(
					() => resolve("overran"),
					timeoutMs + TIMEOUT_GRACE_MS,
				);
			});
			try {
				return await Promise.race([
					entry.driver.exec(entry.sandbox, req.call, {
						timeoutMs,
						maxOutputBytes: cap,
					}),
					overran,
				]);
			} catch (err) {
				// Drivers throw TypeError for a call they cannot run (a tool
				// they do not know, args of the wrong shape): the caller's
				// fault.
				if (err instanceof TypeError)
					throw hostError(400, "invalid_call", err.message);
				throw err;
			} finally {
				clearTimeout(timer);
			}
		});
		if (result === "overran") {
			// The command may still be changing the sandbox: its state is
			// unknown from here on, so it goes.
			await remove(entry);
			return c.json({
				output: `[timed out after ${timeoutMs} ms; the sandbox was stopped]\n`,
				exitCode: 124,
				execMs: performance.now() - started,
				timedOut: true,
				mutates,
			} satisfies ExecResponse & { mutates: boolean });
		}
		return c.json({
			...result,
			mutates,
		} satisfies ExecResponse & { mutates: boolean });
	});

	app.post("/sandboxes/:id/fork", async (c) => {
		const entry = live(c.req.param("id"));
		parse(c, ForkBody, {});
		const release = reserve();
		const started = performance.now();
		let twin: Sandbox;
		try {
			twin = await serially(entry, () => entry.sandbox.fork());
		} finally {
			release();
		}
		const forkMs = performance.now() - started;
		forks.push(forkMs);
		if (forks.length > LATENCY_SAMPLES) forks.shift();
		const id = adopt(entry.driver, entry.template, twin);
		return c.json({ id, forkMs } satisfies ForkResponse, 201);
	});

	app.post("/sandboxes/:id/snapshot", async (c) => {
		const entry = live(c.req.param("id"));
		const req = parse(c, SnapshotRequest);
		const started = performance.now();
		const snap = await serially(entry, () => entry.sandbox.snapshot());
		// The bytes are taken; the upload need not hold the sandbox.
		let ref;
		try {
			ref = await worker.putSnapshot(
				req.task,
				req.state,
				snap.data,
				snap.driver,
			);
		} catch (err) {
			if (err instanceof TrellisError)
				// A refusal (too large, over the project's quota) is the
				// snapshot's, not the host's: passed on as a 4xx, the Worker
				// does not count it as a host failure.
				throw err.status === 413
					? hostError(413, "snapshot_too_large", err.message)
					: err.status >= 400 && err.status < 500 && err.status !== 429
						? hostError(
								err.status as ContentfulStatusCode,
								err.code,
								err.message,
							)
						: hostError(
								502,
								"worker_error",
								`uploading the snapshot failed: ${err.message}`,
							);
			throw err;
		}
		const snapshotMs = performance.now() - started;
		return c.json({ ...ref, snapshotMs } satisfies SnapshotResponse);
	});

	app.delete("/sandboxes/:id", async (c) => {
		const entry = live(c.req.param("id"));
		await remove(entry);
		return c.json({ id: entry.id, stopped: true });
	});

	app.post("/pools/warm", async (c) => {
		const req = parse(c, WarmRequest);
		const { factory } = driverFor(req.template);
		if (req.restore && req.restore.ref.driver !== req.template.driver)
			throw hostError(
				400,
				"driver_mismatch",
				`a ${req.restore.ref.driver} snapshot cannot warm ${req.template.driver} sandboxes`,
			);
		const key = poolKey(req.template, req.restore);
		// The fill runs in the background; `ready` says how far it is.
		pool.warm(key, poolSpec(factory, req.restore), req.count);
		const now = pool.stats().pools.find((p) => p.key === key);
		return c.json({ key, ready: now?.ready ?? 0, target: req.count });
	});

	// ------------------------------------------------- Worker registration

	async function workerPost<T>(path: string, body: unknown): Promise<T> {
		const res = await fetchWorker(worker.url + path, {
			method: "POST",
			headers: {
				authorization: `Bearer ${options.key}`,
				"content-type": "application/json",
			},
			body: JSON.stringify(body),
			signal: AbortSignal.timeout(10_000),
		});
		const text = await res.text();
		if (!res.ok) {
			let code = `http_${res.status}`;
			let message = text.slice(0, 300);
			try {
				const e = JSON.parse(text) as {
					error?: { code?: string; message?: string };
				};
				code = e.error?.code ?? code;
				message = e.error?.message ?? message;
			} catch {
				// Not JSON: keep the status and the text.
			}
			throw new TrellisError({
				status: res.status,
				code,
				message: `POST ${path}: ${message}`,
			});
		}
		return JSON.parse(text) as T;
	}

	async function register(): Promise<RegisterHostResponse> {
		const body: RegisterHostRequest = {
			url: url!,
			capacity,
			drivers: [...drivers.keys()],
			...(options.name !== undefined && { name: options.name }),
		};
		const attempts = options.registerAttempts ?? 5;
		for (let attempt = 1; ; attempt++) {
			try {
				const r = await workerPost<RegisterHostResponse>("/v1/hosts", body);
				registration = r;
				log(`registered as ${r.id}`);
				return r;
			} catch (err) {
				// A refused key or body will not get better by asking again.
				const final =
					attempt >= attempts ||
					(err instanceof TrellisError &&
						err.status >= 400 &&
						err.status < 500 &&
						err.status !== 429);
				if (final) throw err;
				await new Promise((r) => setTimeout(r, 200 * 2 ** attempt));
			}
		}
	}

	async function beat(): Promise<void> {
		if (!registration) return;
		const h = health();
		const body: HeartbeatRequest = {
			sandboxes: h.sandboxes,
			busy: h.busy,
			pools: Object.fromEntries(h.pools.map((p) => [p.key, p.ready])),
		};
		try {
			await workerPost(
				`/v1/hosts/${encodeURIComponent(registration.id)}/heartbeat`,
				body,
			);
		} catch (err) {
			if (err instanceof TrellisError && err.status === 404) {
				// The Worker forgot this host (its record expired or was
				// removed): register again, with a new id and secret.
				log(`the Worker does not know ${registration.id}; registering again`);
				const r = await register();
				scheduleHeartbeat(r.heartbeatMs);
				return;
			}
			log(`heartbeat failed: ${(err as Error).message}`);
		}
	}

	function heartbeat(): Promise<void> {
		// One at a time: a slow Worker must not pile heartbeats up.
		beating ??= beat().finally(() => {
			beating = null;
		});
		return beating;
	}

	function scheduleHeartbeat(heartbeatMs: number): void {
		if (heartbeatTimer) clearInterval(heartbeatTimer);
		// Twice per period, so that one lost beat does not mark the host down.
		heartbeatTimer = setInterval(
			() => void heartbeat().catch((err) => log(String(err))),
			Math.max(50, Math.floor(heartbeatMs / 2)),
		);
		heartbeatTimer.unref();
	}

	// ---------------------------------------------------------- lifecycle

	async function start(): Promise<{ url: string; id: string }> {
		if (server) throw new Error("the host is started already");
		if (options.dataDir) {
			dataDir = path.resolve(options.dataDir);
			await mkdir(dataDir, { recursive: true });
		} else {
			dataDir = await mkdtemp(path.join(tmpdir(), "trellis-host-"));
			ownsDataDir = true;
		}
		const loaded = await loadDrivers(
			{
				dataDir,
				instance: randomBytes(8).toString("hex"),
				maxOutputBytes: ceiling,
				execTimeoutMs,
				...options.templates,
			},
			options.drivers ?? ["workspace", "docker", "sqlite"],
			options.loaders,
		);
		drivers = loaded.drivers;
		for (const [name, why] of loaded.unavailable)
			log(`driver ${name} is not available: ${why}`);
		if (drivers.size === 0) throw new Error("no driver can run here");
		for (const p of options.pools ?? []) {
			const key = poolKey(p.template);
			const factory = drivers.get(p.template.driver)?.factory(p.template);
			if (!factory)
				throw new Error(`pool ${key}: no ${p.template.driver} driver`);
			pool.warm(key, poolSpec(factory), p.count);
		}

		const hostname = options.hostname ?? "127.0.0.1";
		server = createAdaptorServer({ fetch: app.fetch, hostname }) as Server;
		await new Promise<void>((resolve, reject) => {
			server!.once("error", reject);
			server!.listen(options.port ?? 0, hostname, () => resolve());
		});
		const { port } = server.address() as AddressInfo;
		url = options.publicUrl ?? `http://${hostname}:${port}`;
		try {
			const r = await register();
			scheduleHeartbeat(r.heartbeatMs);
		} catch (err) {
			await stop();
			throw err;
		}
		sweepTimer = setInterval(
			() => void sweepIdle(),
			Math.max(100, Math.min(idleMs / 2, 60_000)),
		);
		sweepTimer.unref();
		return { url, id: registration!.id };
	}

	async function shutdown(): Promise<void> {
		if (heartbeatTimer) clearInterval(heartbeatTimer);
		if (sweepTimer) clearInterval(sweepTimer);
		heartbeatTimer = sweepTimer = null;
		if (registration) {
			// Leave the Worker's host list now rather than going stale; a Worker
			// that cannot be reached marks the host down by itself later.
			await fetchWorker(`${worker.url}/v1/hosts/${registration.id}`, {
				method: "DELETE",
				headers: { authorization: `Bearer ${options.key}` },
				signal: AbortSignal.timeout(5000),
			})
				.then((r) => r.body?.cancel())
				.catch(() => undefined);
		}
		await Promise.all([...sandboxes.values()].map(remove));
		await pool.drain();
		for (const d of drivers.values()) await d.stop?.();
		if (server) {
			const s = server;
			await new Promise<void>((resolve) => {
				s.close(() => resolve());
				s.closeAllConnections();
			});
		}
		if (ownsDataDir && dataDir)
			await rm(dataDir, { recursive: true, force: true });
	}

	function stop(): Promise<void> {
		stopping ??= shutdown();
		return stopping;
	}

	return {
		app,
		start,
		stop,
		get id() {
			return registration?.id ?? null;
		},
		get url() {
			return url;
		},
		get drivers() {
			return [...drivers.keys()];
		},
		heartbeat,
		sweepIdle,
		health,
	};
}
