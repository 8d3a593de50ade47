/**
 * The v1 HTTP API as a typed TypeScript client: one method per route, JSON
 * in and out, typed errors, and retries of the calls that are safe to repeat.
 * Request and response types come from `core/api.ts`, so the client and the
 * Worker cannot drift apart.
 */
import type {
	CreatedKey,
	ErrorBody,
	EvictionLogPage,
	GraphPage,
	Hit,
	KeyInfo,
	Lease,
	LookupRequest,
	LookupResponse,
	RecordedCall,
	RecordRequest,
	Project,
	RecordResponse,
	Role,
	SnapshotRef,
	TaskPage,
	TaskStats,
} from "../core/api.ts";
import type { HostInfo } from "../core/host-api.ts";
import type { Call } from "../core/ids.ts";
import type {
	OpenRolloutRequest,
	RolloutCallRequest,
	RolloutCallResponse,
	RolloutSummary,
} from "../core/managed-api.ts";

/**
 * A lookup as the client takes it: `core/api.ts`'s request, with `args` any
 * value (it must still be JSON; the server says so with a 400).
 */
export type LookupInput = Omit<LookupRequest, "call" | "history"> & {
	call: Call;
	history?: readonly Call[];
};

/** A record as the client takes it; see {@link LookupInput}. */
export type RecordInput = Omit<RecordRequest, "calls"> & {
	calls: readonly (Omit<RecordedCall, "args"> & { args?: unknown })[];
};

/** Options of a {@link TrellisClient}. */
export interface TrellisClientOptions {
	/** The Worker's origin, e.g. `http://127.0.0.1:8787`. */
	url: string;
	/** An API key; sent as `Authorization: Bearer <key>`. */
	key: string;
	/** A `fetch` to use instead of the global one (a proxy agent, a tracer). */
	fetch?: typeof fetch;
	/** Extra attempts for a retryable failure (default 3; 0 turns retries off). */
	retries?: number;
	/** Delay before the first retry in ms, doubled on each retry (default 100). */
	backoffMs?: number;
	/** The longest single wait between attempts, `Retry-After` included (default 10 s). */
	maxBackoffMs?: number;
	/** Per-attempt time limit of JSON calls in ms (default 30 s; 0: none). */
	timeoutMs?: number;
	/**
	 * How long a snapshot upload or download may go without moving a byte,
	 * in ms, before the attempt ends as a retryable `timeout` (default 60 s;
	 * 0: no limit). The clock restarts with every chunk sent or received, so
	 * a large blob on a slow link takes as long as it needs, while a stalled
	 * one cannot hold a rollout (and its renewed lease) forever.
	 */
	transferIdleMs?: number;
}

/**
 * Any failure of a client call: an error response of the API, a network
 * failure (`status` 0, code `network_error`) or a timeout (`status` 0, code
 * `timeout`).
 */
export class TrellisError extends Error {
	override readonly name = "TrellisError";
	/** The HTTP status, or 0 when no response arrived. */
	readonly status: number;
	/** The API's error code (`unauthorized`, `stale_cursor`, ...). */
	readonly code: string;
	/** Extra detail the server attached, if any. */
	readonly details: unknown;
	/** Whether trying again later may succeed: 429, 5xx and network failures. */
	readonly retryable: boolean;
	/** How long the server asked us to wait (`Retry-After`) in ms, if it said. */
	readonly retryAfterMs: number | undefined;

	constructor(init: {
		status: number;
		code: string;
		message: string;
		details?: unknown;
		retryAfterMs?: number;
		cause?: unknown;
	}) {
		super(init.message, { cause: init.cause });
		this.status = init.status;
		this.code = init.code;
		this.details = init.details;
		this.retryAfterMs = init.retryAfterMs;
		this.retryable =
			init.status === 0 || init.status === 429 || init.status >= 500;
	}
}

/**
 * How a call may be repeated after a failure. Every call may be repeated
 * after a 429, since the server refused it before doing anything; only an
 * idempotent call may be repeated after a 5xx or a lost connection, where
 * the first attempt may have taken effect.
 */
type RetryPolicy = "idempotent" | "rate-limit-only";

/** How much of a 2xx answer's body an attempt reads. */
type Read = "none" | "text" | "bytes";

/** A 2xx answer, and its body as the attempt read it ("" or no bytes if not). */
interface Answer {
	res: Response;
	text: string;
	bytes: Uint8Array;
}
const NONE = new Uint8Array(0);

/**
 * The time limit of an attempt: `call`, the whole attempt within
 * `timeoutMs`; `transfer`, no `transferIdleMs` without a byte moving;
 * `none`, no limit.
 */
type Limit = "call" | "transfer" | "none";

interface RequestSpec {
	method: "GET" | "POST" | "PUT" | "DELETE";
	path: string;
	query?: Record<string, string | number | undefined>;
	json?: unknown;
	body?: Uint8Array;
	auth?: boolean;
	retry: RetryPolicy;
	/** Default `call`. */
	limit?: Limit;
}

/** The chunk size an upload is streamed in: each chunk taken is progress. */
const UPLOAD_CHUNK = 64 << 10;

function enc(segment: string): string {
	return encodeURIComponent(segment);
}

/** Parses `Retry-After` (delta seconds or an HTTP date) into milliseconds. */
function parseRetryAfter(value: string | null): number | undefined {
	if (value === null || value.trim() === "") return undefined;
	const seconds = Number(value);
	if (Number.isFinite(seconds)) return Math.max(0, seconds * 1000);
	const date = Date.parse(value);
	return Number.isNaN(date) ? undefined : Math.max(0, date - Date.now());
}

function sleep(ms: number): Promise<void> {
	return new Promise((resolve) => setTimeout(resolve, ms));
}

/**
 * A client of one Trellis deployment with one API key.
 *
 * ```ts
 * const trellis = new TrellisClient({ url, key });
 * const res = await trellis.lookup("swe-123", { call, history });
 * ```
 */
export class TrellisClient {
	readonly url: string;
	readonly #key: string;
	readonly #fetch: typeof fetch;
	readonly #retries: number;
	readonly #backoffMs: number;
	readonly #maxBackoffMs: number;
	readonly #timeoutMs: number;
	readonly #transferIdleMs: number;

	constructor(options: TrellisClientOptions) {
		this.url = options.url.replace(/\/+$/, "");
		this.#key = options.key;
		this.#fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
		this.#retries = options.retries ?? 3;
		this.#backoffMs = options.backoffMs ?? 100;
		this.#maxBackoffMs = options.maxBackoffMs ?? 10_000;
		this.#timeoutMs = options.timeoutMs ?? 30_000;
		this.#transferIdleMs = options.transferIdleMs ?? 60_000;
	}

	/** A client of the same deployment with another key. */
	withKey(key: string): TrellisClient {
		return new TrellisClient({
			url: this.url,
			key,
			fetch: this.#fetch,
			retries: this.#retries,
			backoffMs: this.#backoffMs,
			maxBackoffMs: this.#maxBackoffMs,
			timeoutMs: this.#timeoutMs,
			transferIdleMs: this.#transferIdleMs,
		});
	}

	// ------------------------------------------------------------ service

	/** `GET /healthz`: resolves when the Worker answers `ok`; needs no key. */
	async health(): Promise<void> {
		await this.#request({
			method: "GET",
			path: "/healthz",
			auth: false,
			retry: "idempotent",
		});
	}

	// ------------------------------------------------------- admin routes

	/** `POST /v1/projects` (root admin key only): creates a project. */
	createProject(name: string): Promise<Project> {
		return this.#json({
			method: "POST",
			path: "/v1/projects",
			json: { name },
			retry: "rate-limit-only",
		});
	}

	/**
	 * `POST /v1/keys` (admin): creates a key. The secret is in the answer
	 * only; the server keeps a hash.
	 */
	createKey(request: {
		role: Role;
		project?: string;
		name?: string;
	}): Promise<CreatedKey> {
		return this.#json({
			method: "POST",
			path: "/v1/keys",
			json: request,
			retry: "rate-limit-only",
		});
	}

	/**
	 * `GET /v1/keys` (admin): the keys of the caller's project, or (root
	 * admin key) of the project named.
	 */
	async listKeys(query: { project?: string } = {}): Promise<KeyInfo[]> {
		const body = await this.#json<{ keys: KeyInfo[] }>({
			method: "GET",
			path: "/v1/keys",
			query,
			retry: "idempotent",
		});
		return body.keys;
	}

	/** `DELETE /v1/keys/:id` (admin): revokes a key. */
	deleteKey(id: string): Promise<{ id: string; revoked: boolean }> {
		return this.#json({
			method: "DELETE",
			path: `/v1/keys/${enc(id)}`,
			retry: "idempotent",
		});
	}

	/** `GET /v1/tasks`: one page of the project's tasks, by name. */
	listTasks(query: { after?: string; limit?: number } = {}): Promise<TaskPage> {
		return this.#json({
			method: "GET",
			path: "/v1/tasks",
			query,
			retry: "idempotent",
		});
	}

	// -------------------------------------------------------- task routes

	/**
	 * `POST /v1/tasks/:task/lookup`: a hit with the recorded output, or a
	 * miss that says where to resume and what to replay. Give either the
	 * rollout's `history` (every call before `call`) or a `cursor` the graph
	 * holds; a cursor it no longer holds fails with 409 `stale_cursor`.
	 *
	 * Retried after a 5xx or a lost connection although a miss may take a
	 * lease: a lease whose answer was lost only lives until its TTL.
	 */
	lookup(task: string, request: LookupInput): Promise<LookupResponse> {
		return this.#json({
			method: "POST",
			path: `/v1/tasks/${enc(task)}/lookup`,
			json: request,
			retry: "idempotent",
		});
	}

	/** `GET /v1/tasks/:task/results/:id`: a recorded result by its id. */
	result(task: string, id: string): Promise<Hit> {
		return this.#json({
			method: "GET",
			path: `/v1/tasks/${enc(task)}/results/${enc(id)}`,
			retry: "idempotent",
		});
	}

	/**
	 * `POST /v1/tasks/:task/record`: records a run of calls executed from
	 * `from` (the root or a state the graph holds). Idempotent: the first
	 * output recorded for a call stands, later ones come back as conflicts.
	 */
	record(task: string, request: RecordInput): Promise<RecordResponse> {
		return this.#json({
			method: "POST",
			path: `/v1/tasks/${enc(task)}/record`,
			json: request,
			retry: "idempotent",
		});
	}

	/** `POST /v1/tasks/:task/leases`: protects a state's snapshot from eviction. */
	createLease(
		task: string,
		request: { state: string; ttlMs?: number },
	): Promise<Lease> {
		// Not idempotent: a repeat after a lost answer would hold a second lease.
		return this.#json({
			method: "POST",
			path: `/v1/tasks/${enc(task)}/leases`,
			json: request,
			retry: "rate-limit-only",
		});
	}

	/** `POST /v1/tasks/:task/leases/:id/renew`: extends a lease before it expires. */
	renewLease(task: string, id: string, ttlMs?: number): Promise<Lease> {
		return this.#json({
			method: "POST",
			path: `/v1/tasks/${enc(task)}/leases/${enc(id)}/renew`,
			json: ttlMs === undefined ? {} : { ttlMs },
			retry: "idempotent",
		});
	}

	/** `DELETE /v1/tasks/:task/leases/:id`: releases a lease. */
	releaseLease(
		task: string,
		id: string,
	): Promise<{ id: string; released: true }> {
		return this.#json({
			method: "DELETE",
			path: `/v1/tasks/${enc(task)}/leases/${enc(id)}`,
			retry: "idempotent",
		});
	}

	// ------------------------------------------------------------ managed mode

	/** `GET /v1/hosts`: the project's container hosts and whether they are up. */
	async listHosts(): Promise<HostInfo[]> {
		const body = await this.#json<{ hosts: HostInfo[] }>({
			method: "GET",
			path: "/v1/hosts",
			retry: "idempotent",
		});
		return body.hosts;
	}

	/** `POST /v1/tasks/:task/rollouts`: a managed rollout at the root of the task. */
	openRollout(
		task: string,
		request: OpenRolloutRequest,
	): Promise<RolloutSummary> {
		return this.#json({
			method: "POST",
			path: `/v1/tasks/${enc(task)}/rollouts`,
			json: request,
			retry: "rate-limit-only",
		});
	}

	/**
	 * `POST /v1/tasks/:task/rollouts/:id/calls`: one tool call, answered from
	 * the cache or executed on a container host. Not retried after a failure
	 * (the call may have run); no client timeout (a tool may run for minutes).
	 */
	rolloutCall(
		task: string,
		rollout: string,
		call: RolloutCallRequest,
	): Promise<RolloutCallResponse> {
		return this.#json({
			method: "POST",
			path: `/v1/tasks/${enc(task)}/rollouts/${enc(rollout)}/calls`,
			json: call,
			retry: "rate-limit-only",
			limit: "none",
		});
	}

	/** `DELETE /v1/tasks/:task/rollouts/:id`: stops the rollout's sandbox. */
	closeRollout(task: string, rollout: string): Promise<RolloutSummary> {
		return this.#json({
			method: "DELETE",
			path: `/v1/tasks/${enc(task)}/rollouts/${enc(rollout)}`,
			retry: "idempotent",
		});
	}

	/** `GET /v1/tasks/:task/stats`: hit rates, sizes and per-tool counters. */
	stats(task: string): Promise<TaskStats> {
		return this.#json({
			method: "GET",
			path: `/v1/tasks/${enc(task)}/stats`,
			retry: "idempotent",
		});
	}

	/** `GET /v1/tasks/:task/graph`: one page of the task's nodes, in insertion order. */
	graph(
		task: string,
		query: { after?: number; limit?: number } = {},
	): Promise<GraphPage> {
		return this.#json({
			method: "GET",
			path: `/v1/tasks/${enc(task)}/graph`,
			query,
			retry: "idempotent",
		});
	}

	/**
	 * `GET /v1/tasks/:task/evictions`: one page of what eviction took from
	 * the task (nodes and snapshots), oldest first.
	 */
	evictions(
		task: string,
		query: { after?: number; limit?: number } = {},
	): Promise<EvictionLogPage> {
		return this.#json({
			method: "GET",
			path: `/v1/tasks/${enc(task)}/evictions`,
			query,
			retry: "idempotent",
		});
	}

	/**
	 * `PUT /v1/tasks/:task/snapshots/:state`: uploads a snapshot blob of
	 * `state` for `driver` and returns the ref to record with the call. The
	 * Worker streams it into R2, which needs its length up front: hence
	 * bytes, not a stream. Limited by `transferIdleMs`, not `timeoutMs`.
	 */
	putSnapshot(
		task: string,
		state: string,
		data: Uint8Array,
		driver: string,
	): Promise<SnapshotRef> {
		return this.#json({
			method: "PUT",
			path: `/v1/tasks/${enc(task)}/snapshots/${enc(state)}`,
			query: { driver },
			body: data,
			retry: "idempotent",
			limit: "transfer",
		});
	}

	/**
	 * `GET /v1/tasks/:task/snapshots/:state`: the snapshot blob of a state.
	 * Limited by `transferIdleMs`, not `timeoutMs`.
	 */
	async getSnapshot(task: string, state: string): Promise<Uint8Array> {
		const { bytes } = await this.#request(
			{
				method: "GET",
				path: `/v1/tasks/${enc(task)}/snapshots/${enc(state)}`,
				retry: "idempotent",
				limit: "transfer",
			},
			"bytes",
		);
		return bytes;
	}

	// ----------------------------------------------------------- plumbing

	async #json<T>(spec: RequestSpec): Promise<T> {
		const { res, text } = await this.#request(spec, "text");
		try {
			return JSON.parse(text) as T;
		} catch (cause) {
			throw new TrellisError({
				status: res.status,
				code: "bad_response",
				message: `expected JSON from ${spec.method} ${spec.path}, got: ${text.slice(0, 200)}`,
				cause,
			});
		}
	}

	/**
	 * One call with its retries; resolves only to a 2xx response, with its
	 * body read as `read` says within the attempt, so that a body cut off
	 * on the way is retried like any lost answer (and, for a call with a
	 * time limit, read within it).
	 */
	async #request(spec: RequestSpec, read: Read = "none"): Promise<Answer> {
		for (let attempt = 0; ; attempt++) {
			try {
				return await this.#attempt(spec, read);
			} catch (err) {
				if (!(err instanceof TrellisError)) throw err;
				const again =
					attempt < this.#retries &&
					err.retryable &&
					(spec.retry === "idempotent" || err.status === 429);
				if (!again) throw err;
				await sleep(this.#delay(attempt, err.retryAfterMs));
			}
		}
	}

	/** Exponential backoff with full jitter, or what `Retry-After` asks. */
	#delay(attempt: number, retryAfterMs: number | undefined): number {
		if (retryAfterMs !== undefined)
			return Math.min(retryAfterMs, this.#maxBackoffMs);
		const ceiling = Math.min(
			this.#backoffMs * 2 ** attempt,
			this.#maxBackoffMs,
		);
		return Math.random() * ceiling;
	}

	/** The attempt's time limit in ms, and whether progress restarts it. */
	#limit(spec: RequestSpec): { ms: number; idle: boolean } | undefined {
		const limit = spec.limit ?? "call";
		if (limit === "call" && this.#timeoutMs > 0)
			return { ms: this.#timeoutMs, idle: false };
		if (limit === "transfer" && this.#transferIdleMs > 0)
			return { ms: this.#transferIdleMs, idle: true };
		return undefined;
	}

	async #attempt(spec: RequestSpec, read: Read): Promise<Answer> {
		const url = new URL(this.url + spec.path);
		for (const [k, v] of Object.entries(spec.query ?? {}))
			if (v !== undefined) url.searchParams.set(k, String(v));
		const headers: Record<string, string> = {};
		if (spec.auth !== false) headers.authorization = `Bearer ${this.#key}`;
		const limit = this.#limit(spec);
		try {
			return await watchdog(limit, async (signal, progress) => {
				const init: RequestInit = { method: spec.method, headers, signal };
				if (spec.json !== undefined) {
					headers["content-type"] = "application/json";
					init.body = JSON.stringify(spec.json);
				} else if (spec.body !== undefined) {
					headers["content-type"] = "application/octet-stream";
					if (limit?.idle) {
						// Streamed, to see it move; the length still goes first.
						headers["content-length"] = String(spec.body.byteLength);
						init.body = chunks(spec.body, progress);
						init.duplex = "half";
					} else init.body = spec.body;
				}
				const res = await this.#fetch(url, init);
				progress();
				if (!res.ok) throw await errorFrom(res, spec);
				return {
					res,
					text: read === "text" ? await res.text() : "",
					bytes: read === "bytes" ? await readBytes(res, progress) : NONE,
				};
			});
		} catch (cause) {
			if (cause instanceof TrellisError) throw cause;
			const timedOut = cause instanceof Error && cause.name === "TimeoutError";
			throw new TrellisError({
				status: 0,
				code: timedOut ? "timeout" : "network_error",
				message: `${spec.method} ${url.pathname}: ${
					!timedOut
						? describe(cause)
						: limit?.idle
							? `no bytes moved for ${limit.ms} ms`
							: `no answer within ${limit?.ms} ms`
				}`,
				cause,
			});
		}
	}
}

/**
 * `work` with a signal that aborts once the limit is over (never when
 * undefined), and settled by then whether or not `work` heeds the abort:
 * Node 20's own `fetch` can fail to settle when the abort comes while it is
 * still sending a large body (docs/benchmarks-soak.md), and a timed-out call
 * must not wait for it forever. Whatever `work` does later is ignored. With
 * an idle limit, each `progress()` of `work` restarts the clock; otherwise
 * `progress` does nothing.
 */
async function watchdog<T>(
	limit: { ms: number; idle: boolean } | undefined,
	work: (signal: AbortSignal | undefined, progress: () => void) => Promise<T>,
): Promise<T> {
	if (limit === undefined) return work(undefined, () => {});
	const { ms, idle } = limit;
	const controller = new AbortController();
	let timer: ReturnType<typeof setTimeout> | undefined;
	let last = Date.now();
	const expired = new Promise<never>((_, reject) => {
		// One timer, re-armed for what is left when progress came meanwhile,
		// rather than a new timer for every chunk.
		const check = () => {
			const left = last + ms - Date.now();
			if (idle && left > 0) {
				timer = setTimeout(check, left);
				return;
			}
			const reason = new DOMException(`over ${ms} ms`, "TimeoutError");
			controller.abort(reason);
			reject(reason);
		};
		timer = setTimeout(check, ms);
	});
	const progress = idle ? () => void (last = Date.now()) : () => {};
	try {
		return await Promise.race([work(controller.signal, progress), expired]);
	} finally {
		clearTimeout(timer);
	}
}

/** `data` as a stream of chunks, calling `progress` as each is taken. */
function chunks(
	data: Uint8Array,
	progress: () => void,
): ReadableStream<Uint8Array> {
	let offset = 0;
	return new ReadableStream<Uint8Array>({
		pull(controller) {
			progress();
			if (offset >= data.byteLength) return controller.close();
			const end = Math.min(offset + UPLOAD_CHUNK, data.byteLength);
			controller.enqueue(data.subarray(offset, end));
			offset = end;
		},
	});
}

/** A response's whole body, calling `progress` as each chunk arrives. */
async function readBytes(
	res: Response,
	progress: () => void,
): Promise<Uint8Array> {
	if (res.body === null) return NONE;
	const parts: Uint8Array[] = [];
	let size = 0;
	for await (const part of res.body) {
		progress();
		parts.push(part);
		size += part.byteLength;
	}
	const bytes = new Uint8Array(size);
	let at = 0;
	for (const part of parts) {
		bytes.set(part, at);
		at += part.byteLength;
	}
	return bytes;
}

function describe(err: unknown): string {
	if (!(err instanceof Error)) return String(err);
	const cause = err.cause instanceof Error ? `: ${err.cause.message}` : "";
	return `${err.message}${cause}`;
}

/**
 * The typed error of a non-2xx response, from its JSON body when it has one.
 * A body cut off on the way is a lost answer (a retryable `network_error`):
 * its code is unknown, and the same call again gets it whole. A 429's stays
 * a 429: the call was refused, whatever the body said.
 */
async function errorFrom(
	res: Response,
	spec: RequestSpec,
): Promise<TrellisError> {
	let text: string;
	try {
		text = await res.text();
	} catch (cause) {
		// The attempt's time limit reads as a timeout (see #attempt).
		if (cause instanceof Error && cause.name === "TimeoutError") throw cause;
		// A 429 refused the call whatever its body said: still a 429.
		const refused = res.status === 429;
		return new TrellisError({
			status: refused ? 429 : 0,
			code: refused ? "http_429" : "network_error",
			message: `${spec.method} ${spec.path}: the ${res.status} answer was cut off: ${describe(cause)}`,
			retryAfterMs: parseRetryAfter(res.headers.get("retry-after")),
			cause,
		});
	}
	let code = `http_${res.status}`;
	let message = text.slice(0, 500) || res.statusText;
	let details: unknown;
	try {
		const body = JSON.parse(text) as Partial<ErrorBody>;
		if (body.error && typeof body.error.code === "string") {
			code = body.error.code;
			message = body.error.message ?? message;
			details = body.error.details;
		}
	} catch {
		// Not JSON (a proxy's error page, say): keep the status-derived code.
	}
	return new TrellisError({
		status: res.status,
		code,
		message: `${spec.method} ${spec.path}: ${message}`,
		details,
		retryAfterMs: parseRetryAfter(res.headers.get("retry-after")),
	});
}
