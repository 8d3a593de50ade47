/** Requests against the Worker under test, with a project and keys per test file. */
import {
	createExecutionContext,
	createScheduledController,
	waitOnExecutionContext,
} from "cloudflare:test";
import { env, exports } from "cloudflare:workers";
import { expect } from "vitest";
import worker from "../../functions/index.ts";
import type { Call, RecordedCall, SnapshotRef } from "../../core/api.ts";
import { now } from "../../core/clock.ts";
import { ROOT_ID, callKey, childId } from "../../core/ids.ts";

export const ROOT_KEY = "test-root-admin-key";
export { ROOT_ID };

export interface Reply<T = any> {
	status: number;
	body: T;
	headers: Headers;
}

/**
 * Sends a request and reads the whole body (JSON when it is JSON). With
 * `env`, the Worker's fetch handler runs under those bindings instead of the
 * configured ones (a test's swapped binding or variable).
 */
export async function api<T = any>(
	method: string,
	path: string,
	opts: {
		key?: string;
		json?: unknown;
		body?: BodyInit;
		headers?: Record<string, string>;
		env?: Env;
	} = {},
): Promise<Reply<T>> {
	const headers: Record<string, string> = { ...opts.headers };
	if (opts.key !== undefined) headers.authorization = `Bearer ${opts.key}`;
	let body = opts.body;
	if (opts.json !== undefined) {
		headers["content-type"] = "application/json";
		body = JSON.stringify(opts.json);
	}
	const request = new Request(`https://trellis.test${path}`, {
		method,
		headers,
		body,
	});
	let res: Response;
	if (opts.env) {
		const ctx = createExecutionContext();
		res = await worker.fetch(request, opts.env, ctx);
		await waitOnExecutionContext(ctx);
	} else {
		res = await exports.default.fetch(request);
	}
	const text = await res.text();
	const isJson = res.headers.get("content-type")?.includes("json");
	return {
		status: res.status,
		body: (isJson ? JSON.parse(text) : text) as T,
		headers: res.headers,
	};
}

/** Asserts an error reply: its status and code, and the JSON error shape. */
export function expectError(r: Reply, status: number, code: string): void {
	expect({ status: r.status, code: r.body?.error?.code }).toEqual({
		status,
		code,
	});
	expect(typeof r.body.error.message).toBe("string");
}

/** Creates a project and returns a key of each role in it. */
export async function project(name: string) {
	const p = await api("POST", "/v1/projects", {
		key: ROOT_KEY,
		json: { name },
	});
	expect(p.status).toBe(201);
	const key = async (role: string) => {
		const r = await api("POST", "/v1/keys", {
			key: ROOT_KEY,
			json: { project: name, role },
		});
		expect(r.status).toBe(201);
		return r.body.key as string;
	};
	return {
		name,
		trainer: await key("trainer"),
		host: await key("host"),
		admin: await key("admin"),
	};
}

export const bash = (cmd: string, mutates = true): Call => ({
	tool: "bash",
	args: { cmd },
	mutates,
});
export const run = (
	call: Call,
	output: string,
	execMs = 100,
	exitCode = 0,
): RecordedCall => ({
	...call,
	output,
	execMs,
	exitCode,
});

/**
 * The Worker's bindings with its edge cache turned off: a record sent under
 * them leaves the first lookup to the task graph.
 */
/**
 * `text` as a body the runtime cannot know the length of: it is sent
 * without `Content-Length`, and a body limit has to count it as it streams.
 */
export function unsizedBody(text: string): ReadableStream<Uint8Array> {
	const bytes = new TextEncoder().encode(text);
	return new ReadableStream({
		start(controller) {
			controller.enqueue(bytes);
			controller.close();
		},
	});
}

export const NO_EDGE: Env = {
	...env,
	// `wrangler types` types each variable as its configured value.
	EDGE_CACHE_BYTES: "0" as string as Env["EDGE_CACHE_BYTES"],
};

/** A per-test task client bound to one key (and to `bindings`, see {@link api}). */
export function taskApi(key: string, task: string, bindings?: Env) {
	const base = `/v1/tasks/${task}`;
	const o = { key, env: bindings };
	return {
		lookup: (json: unknown) => api("POST", `${base}/lookup`, { ...o, json }),
		record: (json: unknown) => api("POST", `${base}/record`, { ...o, json }),
		stats: () => api("GET", `${base}/stats`, o),
		graph: (q = "") => api("GET", `${base}/graph${q}`, o),
		evictions: (q = "") => api("GET", `${base}/evictions${q}`, o),
		result: (id: string) => api("GET", `${base}/results/${id}`, o),
		lease: (json: unknown) => api("POST", `${base}/leases`, { ...o, json }),
		renew: (id: string, json: unknown = {}) =>
			api("POST", `${base}/leases/${id}/renew`, { ...o, json }),
		release: (id: string) => api("DELETE", `${base}/leases/${id}`, o),
	};
}

/** The state after one state-changing call from `from` (the root by default). */
export const stateAfter = (call: Call, from: string = ROOT_ID): string =>
	childId(from, callKey(call));

/**
 * A snapshot blob of `state` in R2, keyed as the upload route keys it
 * (`snapshots/{project}/{task}/{state}/{name}`), and its ref: what a record
 * of the call that leads to `state` may carry.
 */
export async function snapshotBlob(
	project: string,
	task: string,
	state: string,
	bytes: number,
	name = "blob",
): Promise<SnapshotRef> {
	const key = `snapshots/${project}/${task}/${state}/${name}`;
	await env.BLOBS.put(key, "x".repeat(bytes), {
		customMetadata: { driver: "workspace" },
	});
	return { driver: "workspace", key, bytes };
}

/** Runs the Worker's cron once, at the test clock's now, to its end. */
export async function runCron(): Promise<void> {
	const ctx = createExecutionContext();
	const controller = createScheduledController({
		scheduledTime: now(),
		cron: "*/5 * * * *",
	});
	await worker.scheduled(controller, env, ctx);
	await waitOnExecutionContext(ctx);
}
