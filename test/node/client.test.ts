/**
 * The HTTP client against a real local stack (`wrangler dev` with local D1,
 * R2 and Durable Objects): one method per route, typed errors, and the
 * server agreeing with the client's ids.
 */
import { readFileSync } from "node:fs";
import {
	createServer,
	type IncomingMessage,
	type Server,
	type ServerResponse,
} from "node:http";
import type { AddressInfo } from "node:net";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { startLocalStack, type LocalStack } from "../../bin/local-stack.ts";
import {
	ROOT_ID,
	TrellisClient,
	TrellisError,
	childId,
	callKey,
	obsId,
	type Call,
} from "../../client/index.ts";
import { cleanTmp, taskName, tmp } from "./helpers.ts";

let stack: LocalStack;
let trainer: TrellisClient;
let admin: TrellisClient;

beforeAll(async () => {
	stack = await startLocalStack({ persistTo: await tmp("client-state") });
	trainer = new TrellisClient({ url: stack.url, key: stack.trainerKey });
	admin = new TrellisClient({ url: stack.url, key: stack.adminKey });
});
afterAll(async () => {
	await stack?.stop();
	await cleanTmp();
});

/** Runs `fn`, expecting a TrellisError, and returns it. */
async function failure(fn: () => Promise<unknown>): Promise<TrellisError> {
	try {
		await fn();
	} catch (err) {
		if (err instanceof TrellisError) return err;
		throw err;
	}
	throw new Error("expected the call to fail");
}

/** A fetch that counts the requests it sends. */
function counting(): { fetch: typeof fetch; count: () => number } {
	let n = 0;
	return {
		fetch: (input, init) => {
			n++;
			return fetch(input, init);
		},
		count: () => n,
	};
}

const M = (cmd: string): Call => ({
	tool: "bash",
	args: { cmd },
	mutates: true,
});
const R = (cmd: string): Call => ({
	tool: "bash",
	args: { cmd },
	mutates: false,
});
const run = (c: Call, output: string) => ({
	...c,
	output,
	exitCode: 0,
	execMs: 5,
});

describe("typed errors", () => {
	it("a bad key is a 401 unauthorized, not retried", async () => {
		const f = counting();
		const bad = new TrellisClient({
			url: stack.url,
			key: "not-a-key",
			fetch: f.fetch,
		});
		const err = await failure(() => bad.stats("anything"));
		expect([err.status, err.code, err.retryable]).toEqual([
			401,
			"unauthorized",
			false,
		]);
		expect(f.count()).toBe(1);
	});

	it("a trainer key may not create keys: 403 forbidden", async () => {
		const err = await failure(() => trainer.createKey({ role: "trainer" }));
		expect([err.status, err.code]).toEqual([403, "forbidden"]);
	});

	it("a lookup with both history and cursor is a 400 invalid_request that records nothing", async () => {
		const task = taskName("bad-lookup");
		const err = await failure(() =>
			trainer.lookup(task, { call: M("x"), history: [], cursor: ROOT_ID }),
		);
		expect([err.status, err.code]).toEqual([400, "invalid_request"]);
		const none = await failure(() => trainer.graph(task));
		expect([none.status, none.code]).toEqual([404, "task_not_found"]);
	});

	it("a result nobody recorded is a 404 not_found", async () => {
		const err = await failure(() =>
			trainer.result(taskName("no-result"), childId(ROOT_ID, callKey(M("x")))),
		);
		expect([err.status, err.code]).toEqual([404, "not_found"]);
	});

	it("a record from a state the graph does not hold is a 409 unknown_state", async () => {
		const from = childId(ROOT_ID, callKey(M("never recorded")));
		const err = await failure(() =>
			trainer.record(taskName("unknown-state"), {
				from,
				calls: [run(M("y"), "y")],
			}),
		);
		expect([err.status, err.code, err.retryable]).toEqual([
			409,
			"unknown_state",
			false,
		]);
	});

	it("a lookup by a cursor the graph does not hold is a 409 stale_cursor", async () => {
		const cursor = childId(ROOT_ID, callKey(M("never recorded")));
		const err = await failure(() =>
			trainer.lookup(taskName("stale"), { call: M("z"), cursor }),
		);
		expect([err.status, err.code]).toEqual([409, "stale_cursor"]);
	});

	it("renewing a lease that does not exist is a 404 lease_not_found", async () => {
		const err = await failure(() =>
			trainer.renewLease(taskName("lease"), "no-such-lease"),
		);
		expect([err.status, err.code]).toEqual([404, "lease_not_found"]);
	});

	it("creating a project that exists is a 409 project_exists", async () => {
		const err = await failure(() => admin.createProject(stack.project));
		expect([err.status, err.code]).toEqual([409, "project_exists"]);
	});
});

describe("routes", () => {
	it("the server derives the same ids as the vectors for a recorded path", async () => {
		const vectors = JSON.parse(
			readFileSync(new URL("../vectors/ids.json", import.meta.url), "utf8"),
		) as { paths: { calls: Call[]; ids: string[] }[] };
		// [M1, R1, M2, R2]: stateless calls in between, the case ids get wrong most easily.
		const v = vectors.paths.find(
			(p) => p.calls.length === 4 && p.calls[1].mutates === false,
		)!;
		const res = await trainer.record(taskName("vectors"), {
			from: ROOT_ID,
			calls: v.calls.map((c, i) => run(c, `out ${i}`)),
		});
		expect(res.results.map((r) => r.id)).toEqual(v.ids);
		expect(res.results.every((r) => r.status === "recorded")).toBe(true);
		expect(res.state).toBe(v.ids[2]);
	});

	it("a recorded call is a hit by history, by cursor and by result id", async () => {
		const task = taskName("hit");
		const rec = await trainer.record(task, {
			from: ROOT_ID,
			calls: [
				run(M("make"), "built\n"),
				{ ...run(R("cat log"), "log\n"), exitCode: 3 },
			],
		});
		const byHistory = await trainer.lookup(task, {
			call: R("cat log"),
			history: [M("make")],
		});
		expect(byHistory).toMatchObject({
			status: "hit",
			output: "log\n",
			exitCode: 3,
			state: rec.state,
		});
		const byCursor = await trainer.lookup(task, {
			call: R("cat log"),
			cursor: rec.state,
		});
		expect(byCursor).toMatchObject({
			status: "hit",
			id: obsId(rec.state, callKey(R("cat log"))),
		});
		const byId = await trainer.result(task, rec.state);
		expect(byId).toMatchObject({
			status: "hit",
			output: "built\n",
			id: rec.state,
		});
	});

	it("recording the same call with another output keeps the first and reports a conflict", async () => {
		const task = taskName("conflict");
		await trainer.record(task, {
			from: ROOT_ID,
			calls: [run(M("date"), "monday")],
		});
		const again = await trainer.record(task, {
			from: ROOT_ID,
			calls: [run(M("date"), "tuesday")],
		});
		expect(again.conflicts).toBe(1);
		expect(again.results[0].status).toBe("conflict");
		const hit = await trainer.lookup(task, { call: M("date"), history: [] });
		expect(hit.status === "hit" && hit.output).toBe("monday");
		expect((await trainer.stats(task)).tools.bash.nondeterministic).toBe(true);
	});

	it("a snapshot uploads, downloads byte for byte, and is offered with a lease on a miss below it", async () => {
		const task = taskName("snap");
		const state = childId(ROOT_ID, callKey(M("setup")));
		const blob = new Uint8Array(100_000).map((_, i) => (i * 7) % 256);
		const ref = await trainer.putSnapshot(task, state, blob, "workspace");
		expect(ref).toMatchObject({ driver: "workspace", bytes: blob.length });
		expect(
			Buffer.from(await trainer.getSnapshot(task, state)).equals(
				Buffer.from(blob),
			),
		).toBe(true);

		await trainer.record(task, {
			from: ROOT_ID,
			calls: [{ ...run(M("setup"), ""), snapshot: ref }],
		});
		const miss = await trainer.lookup(task, {
			call: M("next"),
			history: [M("setup")],
		});
		expect(miss.status).toBe("miss");
		if (miss.status !== "miss") return;
		expect(miss.snapshot).toMatchObject({ state, depth: 1, key: ref.key });
		expect(miss.resume).toBe(state);
		expect(miss.replay).toEqual([]);
		expect(miss.lease?.state).toBe(state);
		expect((await trainer.stats(task)).leases).toBe(1);
		await trainer.releaseLease(task, miss.lease!.id);
		expect((await trainer.stats(task)).leases).toBe(0);
	});

	it("a state with no snapshot blob is a 404", async () => {
		const err = await failure(() =>
			trainer.getSnapshot(taskName("nosnap"), ROOT_ID),
		);
		expect(err.status).toBe(404);
	});

	it("a lease is created, renewed to a later expiry, and released", async () => {
		const task = taskName("lease");
		const rec = await trainer.record(task, {
			from: ROOT_ID,
			calls: [run(M("a"), "")],
		});
		const lease = await trainer.createLease(task, {
			state: rec.state,
			ttlMs: 1000,
		});
		expect(lease.state).toBe(rec.state);
		const renewed = await trainer.renewLease(task, lease.id, 60_000);
		expect(renewed.expiresAt).toBeGreaterThan(lease.expiresAt);
		expect(await trainer.releaseLease(task, lease.id)).toEqual({
			id: lease.id,
			released: true,
		});
		expect((await trainer.stats(task)).leases).toBe(0);
	});

	it("an admin key creates, lists and revokes a key, which then gets a 401", async () => {
		const created = await admin.createKey({
			role: "trainer",
			project: stack.project,
			name: "temp",
		});
		const temp = trainer.withKey(created.key);
		await temp.listTasks();
		const keys = await admin.listKeys({ project: stack.project });
		expect(keys.find((k) => k.id === created.id)).toMatchObject({
			role: "trainer",
			name: "temp",
		});
		expect(JSON.stringify(keys)).not.toContain(created.key);
		expect(await admin.deleteKey(created.id)).toEqual({
			id: created.id,
			revoked: true,
		});
		const err = await failure(() => temp.listTasks());
		expect([err.status, err.code]).toEqual([401, "unauthorized"]);
	});

	it("lists the project's tasks once they have something recorded", async () => {
		const task = taskName("listed");
		await trainer.record(task, { from: ROOT_ID, calls: [run(M("a"), "")] });
		// The task index in D1 is brought up to date shortly after a change.
		let names: string[] = [];
		for (const deadline = Date.now() + 15_000; Date.now() < deadline;) {
			names = (await trainer.listTasks({ limit: 1000 })).tasks.map(
				(t) => t.task,
			);
			if (names.includes(task)) break;
			await new Promise((r) => setTimeout(r, 250));
		}
		expect(names).toContain(task);
	});
});

/**
 * A real HTTP server that answers with the next canned response (then the
 * last one again): a string body as it is, any other as JSON. A response
 * with `cut` stops halfway through its body and drops the connection.
 */
async function scripted(
	responses: {
		status: number;
		headers?: Record<string, string>;
		body: unknown;
		cut?: boolean;
	}[],
): Promise<{ url: string; hits: () => number; close: () => Promise<void> }> {
	let n = 0;
	const server = createServer((req: IncomingMessage, res: ServerResponse) => {
		const r = responses[Math.min(n++, responses.length - 1)];
		const body = typeof r.body === "string" ? r.body : JSON.stringify(r.body);
		req.resume();
		res.writeHead(r.status, {
			"content-type": "application/json",
			"content-length": String(Buffer.byteLength(body)),
			...r.headers,
		});
		if (r.cut) {
			res.write(body.slice(0, body.length >> 1));
			setTimeout(() => res.destroy(), 20);
		} else res.end(body);
	});
	await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
	const { port } = server.address() as AddressInfo;
	return {
		url: `http://127.0.0.1:${port}`,
		hits: () => n,
		close: async () => {
			server.closeAllConnections();
			await new Promise((resolve) => server.close(resolve));
		},
	};
}

/** Starts `server` on a free local port and returns its URL. */
async function listen(server: Server): Promise<string> {
	await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
	const { port } = server.address() as AddressInfo;
	return `http://127.0.0.1:${port}`;
}

/** Stops `server`, cutting any connection still open. */
async function close(server: Server): Promise<void> {
	server.closeAllConnections();
	await new Promise((resolve) => server.close(resolve));
}

describe("retries", () => {
	const unavailable = {
		status: 503,
		body: { error: { code: "unavailable", message: "busy" } },
	};
	const stats = { status: 200, body: { task: "t", lookups: 0 } };

	it("an idempotent call is retried after 5xx until it succeeds", async () => {
		const s = await scripted([unavailable, unavailable, stats]);
		const c = new TrellisClient({ url: s.url, key: "k", backoffMs: 1 });
		expect(await c.stats("t")).toEqual(stats.body);
		expect(s.hits()).toBe(3);
		await s.close();
	});

	it("a call that is not idempotent is not retried after a 5xx", async () => {
		const s = await scripted([unavailable, { status: 201, body: {} }]);
		const c = new TrellisClient({ url: s.url, key: "k", backoffMs: 1 });
		const err = await failure(() => c.createLease("t", { state: ROOT_ID }));
		expect([err.status, err.code, err.retryable]).toEqual([
			503,
			"unavailable",
			true,
		]);
		expect(s.hits()).toBe(1);
		await s.close();
	});

	it("a 429 is retried for any call, after the Retry-After the server asked for", async () => {
		const limited = {
			status: 429,
			headers: { "retry-after": "1" },
			body: { error: { code: "rate_limited", message: "slow down" } },
		};
		const s = await scripted([
			limited,
			{ status: 201, body: { id: "l", state: ROOT_ID, expiresAt: 1 } },
		]);
		const c = new TrellisClient({ url: s.url, key: "k", backoffMs: 1 });
		const t0 = Date.now();
		expect((await c.createLease("t", { state: ROOT_ID })).id).toBe("l");
		expect(Date.now() - t0).toBeGreaterThanOrEqual(900);
		expect(s.hits()).toBe(2);
		await s.close();
	});

	it("gives up after the configured retries with the last error", async () => {
		const s = await scripted([unavailable]);
		const c = new TrellisClient({
			url: s.url,
			key: "k",
			backoffMs: 1,
			retries: 2,
		});
		const err = await failure(() => c.stats("t"));
		expect(err.status).toBe(503);
		expect(s.hits()).toBe(3);
		await s.close();
	});

	it("a refused connection is a retryable network_error, retried then reported", async () => {
		const s = await scripted([stats]);
		const url = s.url;
		await s.close(); // nothing listens there now
		const f = counting();
		const c = new TrellisClient({
			url,
			key: "k",
			backoffMs: 1,
			retries: 2,
			fetch: f.fetch,
		});
		const err = await failure(() => c.stats("t"));
		expect([err.status, err.code, err.retryable]).toEqual([
			0,
			"network_error",
			true,
		]);
		expect(f.count()).toBe(3);
	});
});

describe("cut-off answers", () => {
	const stale = {
		status: 409,
		body: JSON.stringify({
			error: { code: "stale_cursor", message: "that state is gone" },
		}),
	};

	it("an error answer cut off mid-body is a retryable network_error", async () => {
		const s = await scripted([{ ...stale, cut: true }]);
		try {
			const c = new TrellisClient({ url: s.url, key: "k", retries: 0 });
			const err = await failure(() =>
				c.lookup("t", { cursor: ROOT_ID, call: M("x") }),
			);
			expect([err.status, err.code, err.retryable]).toEqual([
				0,
				"network_error",
				true,
			]);
			expect(err.message).toContain("the 409 answer was cut off");
		} finally {
			await s.close();
		}
	});

	it("an idempotent call retries it, and gets the answer's code", async () => {
		const s = await scripted([{ ...stale, cut: true }, stale]);
		try {
			const c = new TrellisClient({ url: s.url, key: "k", backoffMs: 1 });
			const err = await failure(() =>
				c.lookup("t", { cursor: ROOT_ID, call: M("x") }),
			);
			expect([err.status, err.code]).toEqual([409, "stale_cursor"]);
			expect(s.hits()).toBe(2);
		} finally {
			await s.close();
		}
	});

	it("a 429 cut off mid-body is still a 429, retried for any call", async () => {
		const lease = { id: "l1", state: ROOT_ID, expiresAt: 1 };
		const s = await scripted([
			{
				status: 429,
				headers: { "retry-after": "0" },
				body: JSON.stringify({
					error: { code: "rate_limited", message: "slow down" },
				}),
				cut: true,
			},
			{ status: 201, body: JSON.stringify(lease) },
		]);
		try {
			// A lease is not idempotent: only a 429 may be repeated.
			const c = new TrellisClient({ url: s.url, key: "k", backoffMs: 1 });
			expect(await c.createLease("t", { state: ROOT_ID })).toEqual(lease);
			expect(s.hits()).toBe(2);
		} finally {
			await s.close();
		}
	});

	it("a snapshot download cut off mid-body is retried", async () => {
		const blob = "x".repeat(64 << 10);
		const s = await scripted([
			{ status: 200, body: blob, cut: true },
			{ status: 200, body: blob },
		]);
		try {
			const c = new TrellisClient({ url: s.url, key: "k", backoffMs: 1 });
			const bytes = await c.getSnapshot("t", ROOT_ID);
			expect(bytes.length).toBe(blob.length);
			expect(s.hits()).toBe(2);
		} finally {
			await s.close();
		}
	});
});

describe("time limits", () => {
	it("a call whose fetch never settles, even once aborted, ends as a retryable timeout", async () => {
		// Node 20's own fetch can do this when the abort comes while it is
		// still sending a large body (docs/benchmarks-soak.md).
		let sent = 0;
		const c = new TrellisClient({
			url: "http://127.0.0.1:9",
			key: "k",
			timeoutMs: 50,
			retries: 1,
			backoffMs: 1,
			fetch: () => {
				sent++;
				return new Promise<Response>(() => {});
			},
		});
		const err = await failure(() =>
			c.record("t", { from: ROOT_ID, calls: [run(M("x"), "out")] }),
		);
		expect([err.status, err.code, err.retryable]).toEqual([0, "timeout", true]);
		expect(err.message).toContain("no answer within 50 ms");
		expect(sent).toBe(2);
	});

	it("leaves no timer behind once a call is answered", async () => {
		vi.useFakeTimers();
		try {
			const c = new TrellisClient({
				url: "http://127.0.0.1:9",
				key: "k",
				fetch: async () => Response.json({ task: "t", lookups: 0 }),
			});
			await c.stats("t");
			expect(vi.getTimerCount()).toBe(0);
		} finally {
			vi.useRealTimers();
		}
	});

	it("a snapshot download that keeps moving outlasts timeoutMs and the idle limit", async () => {
		// 8 chunks, 60 ms apart: 420 ms in all, never 300 ms without a byte.
		const chunk = "x".repeat(64 << 10);
		const server = createServer((req, res) => {
			req.resume();
			res.writeHead(200, {
				"content-type": "application/octet-stream",
				"content-length": String(chunk.length * 8),
			});
			let sent = 0;
			const timer = setInterval(() => {
				res.write(chunk);
				if (++sent === 8) {
					clearInterval(timer);
					res.end();
				}
			}, 60);
		});
		const url = await listen(server);
		try {
			const c = new TrellisClient({
				url,
				key: "k",
				timeoutMs: 50,
				transferIdleMs: 300,
				retries: 0,
			});
			const t0 = Date.now();
			const bytes = await c.getSnapshot("t", ROOT_ID);
			expect(bytes.length).toBe(chunk.length * 8);
			expect(Date.now() - t0).toBeGreaterThan(300);
		} finally {
			await close(server);
		}
	});

	it("a snapshot upload that keeps moving outlasts the idle limit, and says its length up front", async () => {
		const blob = new Uint8Array(1 << 20).fill(7);
		let length: string | null = null;
		let received = 0;
		const c = new TrellisClient({
			url: "http://127.0.0.1:9",
			key: "k",
			timeoutMs: 50,
			transferIdleMs: 300,
			retries: 0,
			// A peer that takes 60 ms over each chunk it reads: 16 chunks
			// of 64 KiB, about a second in all.
			fetch: async (_input, init) => {
				length = new Headers(init?.headers).get("content-length");
				const body = init?.body as ReadableStream<Uint8Array>;
				for await (const chunk of body) {
					received += chunk.byteLength;
					await new Promise((resolve) => setTimeout(resolve, 60));
				}
				return Response.json(
					{ driver: "d", key: "k1", bytes: received },
					{ status: 201 },
				);
			},
		});
		const ref = await c.putSnapshot("t", ROOT_ID, blob, "d");
		expect(ref.bytes).toBe(blob.length);
		// The Worker streams the blob into R2, which needs its length first.
		expect(length).toBe(String(blob.length));
	});

	it("a snapshot download that stops moving ends as a retryable timeout", async () => {
		const server = createServer((req, res) => {
			req.resume();
			res.writeHead(200, {
				"content-type": "application/octet-stream",
				"content-length": String(1 << 20),
			});
			res.write("x".repeat(64 << 10)); // and nothing more
		});
		const url = await listen(server);
		try {
			const c = new TrellisClient({
				url,
				key: "k",
				transferIdleMs: 200,
				retries: 1,
				backoffMs: 1,
			});
			const err = await failure(() => c.getSnapshot("t", ROOT_ID));
			expect([err.status, err.code, err.retryable]).toEqual([
				0,
				"timeout",
				true,
			]);
			expect(err.message).toContain("no bytes moved for 200 ms");
		} finally {
			await close(server);
		}
	});

	it("a snapshot upload the server stops reading ends as a retryable timeout", async () => {
		let requests = 0;
		const framing: (string | undefined)[] = [];
		const server = createServer((req) => {
			requests++;
			// What Node's own fetch put on the wire for the streamed body.
			framing.push(
				req.headers["content-length"],
				req.headers["transfer-encoding"],
			);
			req.pause(); // reads nothing, answers nothing
		});
		const url = await listen(server);
		try {
			const c = new TrellisClient({
				url,
				key: "k",
				transferIdleMs: 300,
				retries: 1,
				backoffMs: 1,
			});
			// More than the socket buffers on both ends hold.
			const blob = new Uint8Array(64 << 20);
			const err = await failure(() => c.putSnapshot("t", ROOT_ID, blob, "d"));
			expect([err.status, err.code, err.retryable]).toEqual([
				0,
				"timeout",
				true,
			]);
			expect(requests).toBe(2);
			// The Worker streams a blob into R2, which needs its length first:
			// a stream body goes with its length, not chunked.
			expect(framing).toEqual([
				String(blob.length),
				undefined,
				String(blob.length),
				undefined,
			]);
		} finally {
			await close(server);
		}
	});

	it("a response whose body stops coming is a timeout too", async () => {
		const server = createServer((req, res) => {
			req.resume();
			res.writeHead(200, { "content-type": "application/json" });
			res.write('{"task":'); // and nothing more
		});
		const c = new TrellisClient({
			url: await listen(server),
			key: "k",
			timeoutMs: 200,
			retries: 0,
		});
		try {
			const err = await failure(() => c.stats("t"));
			expect([err.status, err.code]).toEqual([0, "timeout"]);
		} finally {
			await close(server);
		}
	});
});
