/**
 * The container host against a real local stack: it registers with the
 * Worker and heartbeats, runs real workspace sandboxes (directories and
 * bash), and moves snapshots through the Worker's R2 blob routes with its
 * own key. The test plays the Worker's part in signing: it learns the
 * secret the Worker issued by watching the host's registration answer.
 */
import { execFileSync, spawn } from "node:child_process";
import { existsSync } from "node:fs";
import { mkdir, readdir, writeFile } from "node:fs/promises";
import path from "node:path";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import {
	REPO_ROOT,
	startLocalStack,
	type LocalStack,
} from "../../bin/local-stack.ts";
import { TrellisClient } from "../../client/http.ts";
import type {
	ExecResponse,
	HostHealth,
	HostInfo,
	RegisterHostResponse,
	SnapshotResponse,
	StartSandboxResponse,
} from "../../core/host-api.ts";
import { sign } from "../../core/signing.ts";
import {
	UnknownTemplateError,
	loadDrivers,
	type DriverConfig,
} from "../../host/registry.ts";
import { createHost, type Host, type HostOptions } from "../../host/server.ts";
import { cleanTmp, taskName, tmp } from "./helpers.ts";

let stack: LocalStack;
let trainer: TrellisClient;

/** Docker tests run wherever an engine answers, and always in CI. */
const dockerUp = (() => {
	try {
		execFileSync("docker", ["info"], { stdio: "ignore", timeout: 10_000 });
		return true;
	} catch {
		return false;
	}
})();

/** The host's clock, moved forward by tests instead of sleeping. */
let offsetMs = 0;
const clock = () => Date.now() + offsetMs;

/** A host under test, with the secret the Worker gave it and a way to fail its Worker calls. */
interface Harness {
	host: Host;
	url: string;
	dataDir: string;
	secret: () => string;
	/** Registrations and heartbeats the host sent, in order. */
	sent: string[];
	/** Answer the next heartbeat with this status instead of asking the Worker. */
	failNextHeartbeat: (status: number) => void;
}

const harnesses: Harness[] = [];

async function startHost(extra: Partial<HostOptions> = {}): Promise<Harness> {
	const dataDir = await tmp("host-data");
	let secret = "";
	let fail: number | null = null;
	const sent: string[] = [];
	// Between the host and the real Worker: notes what the host sent and the
	// secret it got, and can stand in for a Worker that forgot the host.
	const watching: typeof fetch = async (input, init) => {
		const url = String(input);
		const route = new URL(url).pathname;
		if (/^\/v1\/hosts(\/[^/]+\/heartbeat)?$/.test(route)) sent.push(route);
		if (route.endsWith("/heartbeat") && fail !== null) {
			const status = fail;
			fail = null;
			return Response.json(
				{ error: { code: "host_not_found", message: "forgotten" } },
				{ status },
			);
		}
		const res = await fetch(input, init);
		if (route === "/v1/hosts" && res.ok)
			secret = ((await res.clone().json()) as RegisterHostResponse).secret;
		return res;
	};
	const host = createHost({
		worker: stack.url,
		key: stack.hostKey,
		drivers: ["workspace"],
		capacity: 8,
		dataDir,
		clock,
		fetch: watching,
		log: () => {},
		// These tests find a sandbox on disk through `pwd`, which an isolated
		// sandbox hides (it sees itself at /work); isolation has its own tests.
		templates: { workspace: { isolate: "none" } },
		...extra,
	});
	const { url } = await host.start();
	const h: Harness = {
		host,
		url,
		dataDir,
		secret: () => secret,
		sent,
		failNextHeartbeat: (status) => {
			fail = status;
		},
	};
	harnesses.push(h);
	return h;
}

let main: Harness;
let seedDir: string;

beforeAll(async () => {
	stack = await startLocalStack({ persistTo: await tmp("host-state") });
	trainer = new TrellisClient({ url: stack.url, key: stack.trainerKey });
	seedDir = await tmp("host-seed");
	await mkdir(path.join(seedDir, "src"));
	await writeFile(path.join(seedDir, "src", "greeting.txt"), "hello seed\n");
	// Room for every sandbox the tests below leave running.
	main = await startHost({
		capacity: 100,
		templates: { workspace: { seeds: { hello: seedDir }, isolate: "none" } },
	});
});
afterAll(async () => {
	for (const h of harnesses) await h.host.stop();
	await stack?.stop();
	await cleanTmp();
});

/** A host's answer, its JSON read (any: tests look at the fields they expect). */
interface Reply {
	status: number;
	json: any;
	headers: Record<string, string>;
}

/** Sends a request signed as the Worker signs it (the harness's secret unless given). */
async function signed(
	h: Harness,
	method: string,
	route: string,
	body?: unknown,
	opts: {
		secret?: string;
		now?: number;
		headers?: Record<string, string>;
	} = {},
): Promise<Reply> {
	const text = body === undefined ? "" : JSON.stringify(body);
	const headers = {
		...sign(
			opts.secret ?? h.secret(),
			method,
			route,
			text,
			opts.now ?? clock(),
		),
		...(body === undefined ? {} : { "content-type": "application/json" }),
		...opts.headers,
	};
	return send(h, method, route, text, headers);
}

async function send(
	h: Harness,
	method: string,
	route: string,
	text: string,
	headers: Record<string, string>,
): Promise<Reply> {
	const res = await fetch(h.url + route, {
		method,
		headers,
		body: method === "GET" || method === "DELETE" ? undefined : text,
	});
	return {
		status: res.status,
		json: await res.json(),
		headers: Object.fromEntries(res.headers),
	};
}

async function start(
	h: Harness,
	body: unknown = { template: { driver: "workspace" } },
) {
	const r = await signed(h, "POST", "/sandboxes", body);
	expect(r.status, JSON.stringify(r.json)).toBe(201);
	return r.json as StartSandboxResponse;
}

async function exec(h: Harness, id: string, cmd: string, extra: object = {}) {
	const r = await signed(h, "POST", `/sandboxes/${id}/exec`, {
		call: { tool: "bash", args: { cmd } },
		...extra,
	});
	expect(r.status, JSON.stringify(r.json)).toBe(200);
	return r.json as ExecResponse & { mutates: boolean };
}

async function health(h: Harness): Promise<HostHealth> {
	const r = await signed(h, "GET", "/health");
	expect(r.status).toBe(200);
	return r.json;
}

async function listed(id: string): Promise<HostInfo | undefined> {
	const res = await fetch(`${stack.url}/v1/hosts`, {
		headers: { authorization: `Bearer ${stack.trainerKey}` },
	});
	const body = (await res.json()) as { hosts: HostInfo[] };
	return body.hosts.find((x) => x.id === id);
}

describe("registration and heartbeats", () => {
	it("registers with the Worker, which lists it up with its URL, capacity and drivers", async () => {
		const info = await listed(main.host.id!);
		expect(info).toMatchObject({
			url: main.url,
			capacity: 100,
			drivers: ["workspace"],
			status: "up",
		});
		expect(main.secret()).toMatch(/^[0-9a-f]{64}$/);
	});

	it("reports its sandboxes in a heartbeat the Worker records", async () => {
		const h = await startHost({ capacity: 4 });
		await start(h);
		await start(h);
		await h.host.heartbeat();
		expect(h.sent.at(-1)).toBe(`/v1/hosts/${h.host.id}/heartbeat`);
		expect(await listed(h.host.id!)).toMatchObject({ sandboxes: 2, busy: 0 });
	});

	it("registers again when the Worker answers a heartbeat with 404, and then only the new secret works", async () => {
		const h = await startHost();
		const oldId = h.host.id!;
		const oldSecret = h.secret();
		h.failNextHeartbeat(404);
		await h.host.heartbeat();
		expect(h.sent.slice(-2)).toEqual([
			`/v1/hosts/${oldId}/heartbeat`,
			"/v1/hosts",
		]);
		expect(h.host.id).not.toBe(oldId);
		expect(h.secret()).not.toBe(oldSecret);
		expect(await listed(h.host.id!)).toMatchObject({ url: h.url });
		const stale = await signed(h, "GET", "/health", undefined, {
			secret: oldSecret,
		});
		expect(stale.status).toBe(401);
		expect(stale.json.error.code).toBe("bad_signature");
		expect((await signed(h, "GET", "/health")).status).toBe(200);
	});

	it("keeps its registration when a heartbeat fails otherwise", async () => {
		const h = await startHost();
		const id = h.host.id;
		h.failNextHeartbeat(503);
		await h.host.heartbeat();
		expect(h.host.id).toBe(id);
		expect(h.sent.at(-1)).toBe(`/v1/hosts/${id}/heartbeat`);
	});

	it("fails to start with a key the Worker refuses", async () => {
		const host = createHost({
			worker: stack.url,
			key: "trk_not-a-key",
			drivers: ["workspace"],
			log: () => {},
		});
		await expect(host.start()).rejects.toMatchObject({
			status: 401,
			code: "unauthorized",
		});
		await host.stop();
	});
});

describe("sandboxes", () => {
	it("starts a fresh workspace and runs commands in it that see earlier commands' files", async () => {
		const sb = await start(main);
		expect(sb.source).toBe("fresh");
		expect(sb.startMs).toBeGreaterThan(0);
		const w = await exec(main, sb.id, "echo hi > f.txt; echo err >&2");
		expect(w).toMatchObject({
			output: "err\n",
			exitCode: 0,
			timedOut: false,
			mutates: true,
		});
		const r = await exec(main, sb.id, "cat f.txt");
		expect(r).toMatchObject({ output: "hi\n", mutates: false });
		const failing = await exec(main, sb.id, "exit 3");
		expect(failing.exitCode).toBe(3);
	});

	it("says whether a call mutates as the call says, or as the driver guesses", async () => {
		const sb = await start(main);
		const r = await signed(main, "POST", `/sandboxes/${sb.id}/exec`, {
			call: { tool: "bash", args: "ls", mutates: true },
		});
		expect(r.json.mutates).toBe(true);
		expect((await exec(main, sb.id, "ls")).mutates).toBe(false);
	});

	it("starts a workspace from a configured seed directory, without changing the seed", async () => {
		const sb = await start(main, {
			template: { driver: "workspace", name: "hello" },
		});
		expect((await exec(main, sb.id, "cat src/greeting.txt")).output).toBe(
			"hello seed\n",
		);
		await exec(main, sb.id, "echo changed > src/greeting.txt");
		const other = await start(main, {
			template: { driver: "workspace", name: "hello" },
		});
		expect((await exec(main, other.id, "cat src/greeting.txt")).output).toBe(
			"hello seed\n",
		);
	});

	it("refuses a template it was not configured with and a driver it does not run", async () => {
		const before = (await health(main)).sandboxes;
		const unknown = await signed(main, "POST", "/sandboxes", {
			template: { driver: "workspace", name: "nope" },
		});
		expect(unknown.status).toBe(400);
		expect(unknown.json.error.code).toBe("unknown_template");
		const docker = await signed(main, "POST", "/sandboxes", {
			template: { driver: "docker" },
		});
		expect(docker.status).toBe(400);
		expect(docker.json.error.code).toBe("driver_unavailable");
		expect((await health(main)).sandboxes).toBe(before);
	});

	it("forks a sandbox into an independent copy in the same state", async () => {
		const sb = await start(main);
		await exec(main, sb.id, "echo base > f");
		const f = await signed(main, "POST", `/sandboxes/${sb.id}/fork`);
		expect(f.status).toBe(201);
		expect(f.json.forkMs).toBeGreaterThan(0);
		const twin = f.json.id as string;
		expect(twin).not.toBe(sb.id);
		expect((await exec(main, twin, "cat f")).output).toBe("base\n");
		await exec(main, twin, "echo twin > f");
		await exec(main, sb.id, "echo orig >> f");
		expect((await exec(main, sb.id, "cat f")).output).toBe("base\norig\n");
		expect((await exec(main, twin, "cat f")).output).toBe("twin\n");
	});

	it("snapshots into the Worker's R2 and restores from it in a new sandbox", async () => {
		const task = taskName("host-snap");
		const state = "a".repeat(64);
		const sb = await start(main);
		await exec(main, sb.id, "mkdir -p d && echo one > d/x && printf two > y");
		const s = await signed(main, "POST", `/sandboxes/${sb.id}/snapshot`, {
			task,
			state,
		});
		expect(s.status, JSON.stringify(s.json)).toBe(200);
		const snap = s.json as SnapshotResponse;
		expect(snap).toMatchObject({
			driver: "workspace",
			key: expect.stringMatching(
				new RegExp(`^snapshots/${stack.project}/${task}/${state}/`),
			),
		});
		expect(snap.snapshotMs).toBeGreaterThan(0);
		// The blob really is in the Worker, as many bytes as the ref says.
		const blob = await trainer.getSnapshot(task, state);
		expect(blob.length).toBe(snap.bytes);
		// Changes after the snapshot are not in it.
		await exec(main, sb.id, "echo later > d/x");
		const { snapshotMs: _, ...ref } = snap;
		const restored = await start(main, {
			template: { driver: "workspace" },
			restore: { task, state, ref },
		});
		expect(restored.source).toBe("restore");
		expect((await exec(main, restored.id, "cat d/x; cat y")).output).toBe(
			"one\ntwo",
		);
		expect((await exec(main, sb.id, "cat d/x")).output).toBe("later\n");
		const h = await health(main);
		expect(h.starts.restore.count).toBeGreaterThanOrEqual(1);
		expect(h.starts.fresh.count).toBeGreaterThanOrEqual(1);
	});

	it("answers 404 for a snapshot the Worker does not hold, and 422 for a blob that is not a workspace, starting nothing", async () => {
		const task = taskName("host-bad-snap");
		const state = "b".repeat(64);
		const before = await health(main);
		const ref = {
			driver: "workspace",
			key: `snapshots/${stack.project}/${task}/${state}/never-uploaded`,
			bytes: 10,
		};
		const missing = await signed(main, "POST", "/sandboxes", {
			template: { driver: "workspace" },
			restore: { task, state, ref },
		});
		expect(missing.status).toBe(404);
		expect(missing.json.error.code).toBe("snapshot_not_found");
		const junk = await trainer.putSnapshot(
			task,
			state,
			new TextEncoder().encode("not a tarball at all"),
			"workspace",
		);
		const corrupt = await signed(main, "POST", "/sandboxes", {
			template: { driver: "workspace" },
			restore: { task, state, ref: junk },
		});
		expect(corrupt.status).toBe(422);
		expect(corrupt.json.error.code).toBe("restore_failed");
		const mismatch = await signed(main, "POST", "/sandboxes", {
			template: { driver: "workspace" },
			restore: { task, state, ref: { ...junk, driver: "docker" } },
		});
		expect(mismatch.status).toBe(400);
		expect(mismatch.json.error.code).toBe("driver_mismatch");
		expect((await health(main)).sandboxes).toBe(before.sandboxes);
	});

	it("stops a sandbox: its directory goes and later requests for it get 404", async () => {
		const sb = await start(main);
		const dir = (await exec(main, sb.id, "pwd")).output.trim();
		expect(existsSync(dir)).toBe(true);
		const d = await signed(main, "DELETE", `/sandboxes/${sb.id}`);
		expect(d.status).toBe(200);
		expect(d.json).toEqual({ id: sb.id, stopped: true });
		expect(existsSync(dir)).toBe(false);
		for (const [method, route, body] of [
			[
				"POST",
				`/sandboxes/${sb.id}/exec`,
				{ call: { tool: "bash", args: "ls" } },
			],
			["POST", `/sandboxes/${sb.id}/fork`, undefined],
			[
				"POST",
				`/sandboxes/${sb.id}/snapshot`,
				{ task: "t", state: "c".repeat(64) },
			],
			["DELETE", `/sandboxes/${sb.id}`, undefined],
		] as const) {
			const r = await signed(main, method, route, body);
			expect(r.status, route).toBe(404);
			expect(r.json.error.code).toBe("sandbox_not_found");
		}
	});

	it("stops a command at the request's time limit and keeps the sandbox usable", async () => {
		const sb = await start(main);
		const r = await exec(main, sb.id, "echo before; sleep 20; echo finished", {
			timeoutMs: 300,
		});
		expect(r.timedOut).toBe(true);
		expect(r.exitCode).toBe(124);
		expect(r.output).toMatch(/^before\n/);
		expect(r.output).not.toContain("finished");
		expect(r.execMs).toBeLessThan(10_000);
		const again = await exec(main, sb.id, "echo alive");
		expect(again).toMatchObject({ output: "alive\n", timedOut: false });
	});

	it("cuts output at the request's cap and says how much it dropped", async () => {
		const sb = await start(main);
		const r = await exec(main, sb.id, "head -c 5000 /dev/zero | tr '\\0' a", {
			maxOutputBytes: 100,
		});
		expect(r.output).toBe(
			`${"a".repeat(100)}\n[output truncated: 4900 more bytes]\n`,
		);
		const whole = await exec(
			main,
			sb.id,
			"head -c 5000 /dev/zero | tr '\\0' a",
		);
		expect(whole.output).toBe("a".repeat(5000));
	});

	it("runs one operation at a time per sandbox, in arrival order", async () => {
		const sb = await start(main);
		const first = exec(main, sb.id, "sleep 0.3; echo 1 >> log");
		const second = exec(main, sb.id, "echo 2 >> log");
		await Promise.all([first, second]);
		expect((await exec(main, sb.id, "cat log")).output).toBe("1\n2\n");
	});
});

describe("signatures", () => {
	/** Each refused request tries to create a sandbox or a file; none may appear. */
	async function refusedChangesNothing(
		attempt: (sandboxId: string) => Promise<{ status: number; json: any }>,
		code: string,
	) {
		const sb = await start(main);
		const before = await health(main);
		const dirs = await readdir(path.join(main.dataDir, "workspace"));
		const r = await attempt(sb.id);
		expect(r.status).toBe(401);
		expect(r.json.error.code).toBe(code);
		expect((await health(main)).sandboxes).toBe(before.sandboxes);
		expect(await readdir(path.join(main.dataDir, "workspace"))).toEqual(dirs);
		expect((await exec(main, sb.id, "ls")).output).toBe("");
	}
	const touch = { call: { tool: "bash", args: { cmd: "touch pwned" } } };

	it("refuses an unsigned request with 401 unsigned", async () => {
		await refusedChangesNothing(async (id) => {
			const text = JSON.stringify(touch);
			return send(main, "POST", `/sandboxes/${id}/exec`, text, {
				"content-type": "application/json",
			});
		}, "unsigned");
		const unsignedStart = await send(
			main,
			"POST",
			"/sandboxes",
			JSON.stringify({ template: { driver: "workspace" } }),
			{},
		);
		expect(unsignedStart.status).toBe(401);
	});

	it("refuses a request signed with another secret with 401 bad_signature", async () => {
		await refusedChangesNothing(
			(id) =>
				signed(main, "POST", `/sandboxes/${id}/exec`, touch, {
					secret: "f".repeat(64),
				}),
			"bad_signature",
		);
	});

	it("refuses a body changed after signing with 401 bad_signature", async () => {
		await refusedChangesNothing(async (id) => {
			const route = `/sandboxes/${id}/exec`;
			const headers = sign(
				main.secret(),
				"POST",
				route,
				JSON.stringify({ call: { tool: "bash", args: "ls" } }),
				clock(),
			);
			return send(main, "POST", route, JSON.stringify(touch), headers);
		}, "bad_signature");
	});

	it("refuses a request signed for another path with 401 bad_signature", async () => {
		await refusedChangesNothing(async (id) => {
			const body = JSON.stringify({ template: { driver: "workspace" } });
			const headers = sign(main.secret(), "POST", "/health", body, clock());
			return send(main, "POST", "/sandboxes", body, headers);
		}, "bad_signature");
	});

	it("refuses a request signed more than 30 s ago with 401 stale", async () => {
		await refusedChangesNothing(
			(id) =>
				signed(main, "POST", `/sandboxes/${id}/exec`, touch, {
					now: clock() - 31_000,
				}),
			"stale",
		);
	});

	it("refuses a replayed request with 401 replayed, and runs its command once", async () => {
		const sb = await start(main);
		const route = `/sandboxes/${sb.id}/exec`;
		const text = JSON.stringify({
			call: { tool: "bash", args: "echo x >> log" },
		});
		const headers = {
			...sign(main.secret(), "POST", route, text, clock()),
			"content-type": "application/json",
		};
		expect((await send(main, "POST", route, text, headers)).status).toBe(200);
		const replay = await send(main, "POST", route, text, headers);
		expect(replay.status).toBe(401);
		expect(replay.json.error.code).toBe("replayed");
		expect((await exec(main, sb.id, "cat log")).output).toBe("x\n");
	});

	it("checks the signature before saying whether a route or sandbox exists", async () => {
		for (const route of ["/nowhere", "/sandboxes/sb_nope/exec", "/health"]) {
			const r = await send(main, "GET", route, "", {});
			expect(r.status, route).toBe(401);
			expect(r.json.error.code).toBe("unsigned");
		}
		const signedUnknown = await signed(main, "GET", "/nowhere");
		expect(signedUnknown.status).toBe(404);
	});
});

describe("bad input", () => {
	it("answers 400 with a code for every malformed body, and starts nothing", async () => {
		const sb = await start(main);
		const before = (await health(main)).sandboxes;
		const cases: [string, string, unknown, string][] = [
			["POST", "/sandboxes", {}, "invalid_request"],
			["POST", "/sandboxes", { template: { driver: "vm" } }, "invalid_request"],
			[
				"POST",
				"/sandboxes",
				{ template: { driver: "workspace" }, extra: 1 },
				"invalid_request",
			],
			[
				"POST",
				"/sandboxes",
				{ template: { driver: "workspace", name: "../../etc" } },
				"unknown_template",
			],
			// Names of properties every object inherits are no seeds either.
			...["constructor", "__proto__", "toString"].map(
				(name) =>
					[
						"POST",
						"/sandboxes",
						{ template: { driver: "workspace", name } },
						"unknown_template",
					] as [string, string, unknown, string],
			),
			[
				"POST",
				"/sandboxes",
				{
					template: { driver: "workspace" },
					restore: { task: "t", state: "nothex", ref: {} },
				},
				"invalid_request",
			],
			["POST", `/sandboxes/${sb.id}/exec`, { call: {} }, "invalid_request"],
			[
				"POST",
				`/sandboxes/${sb.id}/exec`,
				{ call: { tool: "bash", args: "ls" }, timeoutMs: 0 },
				"invalid_request",
			],
			[
				"POST",
				`/sandboxes/${sb.id}/exec`,
				{ call: { tool: "python", args: "print(1)" } },
				"invalid_call",
			],
			[
				"POST",
				`/sandboxes/${sb.id}/exec`,
				{ call: { tool: "bash", args: { cmd: "ls", cwd: "../.." } } },
				"invalid_call",
			],
			["POST", `/sandboxes/${sb.id}/fork`, { deep: true }, "invalid_request"],
			[
				"POST",
				`/sandboxes/${sb.id}/snapshot`,
				{ task: "t" },
				"invalid_request",
			],
			[
				"POST",
				"/pools/warm",
				{ template: { driver: "workspace" } },
				"invalid_request",
			],
		];
		for (const [method, route, body, code] of cases) {
			const r = await signed(main, method, route, body);
			expect(r.status, `${route} ${JSON.stringify(body)}`).toBe(400);
			expect(r.json.error.code, JSON.stringify(body)).toBe(code);
		}
		const route = "/sandboxes";
		const text = "{not json";
		const notJson = await send(main, "POST", route, text, {
			...sign(main.secret(), "POST", route, text, clock()),
			"content-type": "application/json",
		});
		expect(notJson.status).toBe(400);
		expect(notJson.json.error.code).toBe("invalid_json");
		expect((await health(main)).sandboxes).toBe(before);
		expect((await exec(main, sb.id, "ls")).output).toBe("");
	});

	it("answers 413 for a body over its limit", async () => {
		const route = "/sandboxes";
		const text = JSON.stringify({ pad: "x".repeat(3 << 20) });
		const r = await send(main, "POST", route, text, {
			...sign(main.secret(), "POST", route, text, clock()),
			"content-type": "application/json",
		});
		expect(r.status).toBe(413);
		expect(r.json.error.code).toBe("too_large");
	});
});

describe("capacity, idle sandboxes and shutdown", () => {
	it("answers 429 at_capacity for a start or fork beyond its capacity, even when they race", async () => {
		const h = await startHost({ capacity: 2 });
		const body = { template: { driver: "workspace" } };
		const racing = await Promise.all(
			[1, 2, 3].map(() => signed(h, "POST", "/sandboxes", body)),
		);
		expect(racing.map((r) => r.status).sort()).toEqual([201, 201, 429]);
		const refused = racing.find((r) => r.status === 429)!;
		expect(refused.json.error.code).toBe("at_capacity");
		expect(refused.headers["retry-after"]).toBe("1");
		const [a] = racing.filter((r) => r.status === 201);
		const fork = await signed(h, "POST", `/sandboxes/${a.json.id}/fork`);
		expect(fork.status).toBe(429);
		expect((await health(h)).sandboxes).toBe(2);
		await signed(h, "DELETE", `/sandboxes/${a.json.id}`);
		expect((await signed(h, "POST", "/sandboxes", body)).status).toBe(201);
	});

	it("stops sandboxes idle longer than idleMs, but not busy ones or recently used ones", async () => {
		const h = await startHost({ idleMs: 60_000 });
		const idle = await start(h);
		const dir = (await exec(h, idle.id, "pwd")).output.trim();
		const busy = await start(h);
		const running = exec(h, busy.id, "sleep 2; echo done");
		await vi.waitFor(() => expect(h.host.health().busy).toBe(1));
		offsetMs += 61_000;
		try {
			const fresh = await start(h);
			const stopped = await h.host.sweepIdle();
			expect(stopped).toEqual([idle.id]);
			expect(existsSync(dir)).toBe(false);
			const r = await signed(h, "POST", `/sandboxes/${idle.id}/exec`, {
				call: { tool: "bash", args: "ls" },
			});
			expect(r.status).toBe(404);
			expect((await running).output).toBe("done\n");
			expect((await exec(h, fresh.id, "echo ok")).output).toBe("ok\n");
		} finally {
			offsetMs -= 61_000;
		}
	});

	it("sweeps idle sandboxes on its own timer", async () => {
		const h = await startHost({ idleMs: 200 });
		const sb = await start(h);
		const dir = (await exec(h, sb.id, "pwd")).output.trim();
		await vi.waitFor(() => expect(existsSync(dir)).toBe(false), {
			timeout: 5000,
			interval: 50,
		});
		expect((await health(h)).sandboxes).toBe(0);
	});

	it("keeps warm copies of a template ready and hands them out as pool starts", async () => {
		const h = await startHost({
			capacity: 1,
			poolCapacity: 2,
			templates: { workspace: { seeds: { hello: seedDir }, isolate: "none" } },
		});
		const key = "workspace:hello";
		const r = await signed(h, "POST", "/pools/warm", {
			template: { driver: "workspace", name: "hello" },
			count: 2,
		});
		expect(r.status).toBe(200);
		expect(r.json).toMatchObject({ key, target: 2 });
		const ready = async () =>
			(await health(h)).pools.find((p) => p.key === key)?.ready;
		await vi.waitFor(async () => expect(await ready()).toBe(2));
		// Pooled copies sit beside the capacity, which counts handed-out ones.
		const sb = await start(h, {
			template: { driver: "workspace", name: "hello" },
		});
		expect(sb.source).toBe("pool");
		expect((await exec(h, sb.id, "cat src/greeting.txt")).output).toBe(
			"hello seed\n",
		);
		expect((await health(h)).starts.pool.count).toBe(1);
		expect(h.host.health()).toMatchObject({ poolHits: 1, poolMisses: 0 });
		await vi.waitFor(async () => expect(await ready()).toBe(2));
		const off = await signed(h, "POST", "/pools/warm", {
			template: { driver: "workspace", name: "hello" },
			count: 0,
		});
		expect(off.status).toBe(200);
		expect((await health(h)).pools).toEqual([]);
	});

	it("keeps warm copies of a snapshot and starts a restore from one", async () => {
		const h = await startHost();
		const task = taskName("host-warm");
		const state = "d".repeat(64);
		const sb = await start(h);
		await exec(h, sb.id, "echo hot > node.txt");
		const s = await signed(h, "POST", `/sandboxes/${sb.id}/snapshot`, {
			task,
			state,
		});
		const { snapshotMs: _, ...ref } = s.json as SnapshotResponse;
		const restore = { task, state, ref };
		const w = await signed(h, "POST", "/pools/warm", {
			template: { driver: "workspace" },
			restore,
			count: 1,
		});
		expect(w.json.key).toBe(`workspace:@${task}/${state}`);
		await vi.waitFor(async () =>
			expect((await health(h)).pools[0]?.ready).toBe(1),
		);
		const copy = await start(h, { template: { driver: "workspace" }, restore });
		expect(copy.source).toBe("pool");
		expect((await exec(h, copy.id, "cat node.txt")).output).toBe("hot\n");
		// A copy is independent of the others and of the pool's parent.
		await exec(h, copy.id, "echo changed > node.txt");
		await vi.waitFor(async () =>
			expect((await health(h)).pools[0]?.ready).toBe(1),
		);
		const next = await start(h, { template: { driver: "workspace" }, restore });
		expect(next.source).toBe("pool");
		expect((await exec(h, next.id, "cat node.txt")).output).toBe("hot\n");
	});

	it("refuses to warm a template it was not configured with", async () => {
		const unknown = await signed(main, "POST", "/pools/warm", {
			template: { driver: "workspace", name: "nope" },
			count: 1,
		});
		expect(unknown.status).toBe(400);
		expect(unknown.json.error.code).toBe("unknown_template");
	});

	it("stops every sandbox and its server on stop()", async () => {
		const h = await startHost();
		const a = await start(h);
		const b = await start(h);
		const dirs = [
			(await exec(h, a.id, "pwd")).output.trim(),
			(await exec(h, b.id, "pwd")).output.trim(),
		];
		await h.host.stop();
		for (const d of dirs) expect(existsSync(d)).toBe(false);
		await expect(fetch(`${h.url}/health`)).rejects.toThrow();
		await h.host.stop();
	});
});

describe("sqlite and docker through the host", () => {
	/** One call of a driver's tool; the mutates verdict is the driver's own. */
	async function call(h: Harness, id: string, tool: string, args: unknown) {
		const r = await signed(h, "POST", `/sandboxes/${id}/exec`, {
			call: { tool, args },
		});
		expect(r.status, JSON.stringify(r.json)).toBe(200);
		return r.json as ExecResponse & { mutates: boolean };
	}

	it("runs SQL on a copy of Chinook, forks it, and restores it from the Worker", async () => {
		const h = await startHost({ drivers: ["workspace", "sqlite"] });
		expect(h.host.drivers).toContain("sqlite");
		const sb = await start(h, {
			template: { driver: "sqlite", name: "chinook" },
		});
		const count = "select count(*) as n from Artist";
		expect(await call(h, sb.id, "sql", count)).toMatchObject({
			output: "n\n275\n",
			exitCode: 0,
			mutates: false,
		});
		const insert = await call(
			h,
			sb.id,
			"sql",
			"insert into Artist (Name) values ('Trellis')",
		);
		expect(insert.mutates).toBe(true);
		const fork = await signed(h, "POST", `/sandboxes/${sb.id}/fork`);
		const task = taskName("host-sql");
		const state = "e".repeat(64);
		const snap = await signed(h, "POST", `/sandboxes/${sb.id}/snapshot`, {
			task,
			state,
		});
		expect(snap.status).toBe(200);
		const { snapshotMs: _, ...ref } = snap.json as SnapshotResponse;
		expect(ref.driver).toBe("sqlite");
		await call(h, sb.id, "sql", "delete from Artist where Name = 'Trellis'");
		const restored = await start(h, {
			template: { driver: "sqlite", name: "chinook" },
			restore: { task, state, ref },
		});
		for (const id of [fork.json.id as string, restored.id])
			expect((await call(h, id, "sql", count)).output).toBe("n\n276\n");
		expect((await call(h, sb.id, "sql", count)).output).toBe("n\n275\n");
		const unknown = await signed(h, "POST", "/sandboxes", {
			template: { driver: "sqlite", name: "northwind" },
		});
		expect(unknown.status).toBe(400);
		expect(unknown.json.error.code).toBe("unknown_template");
	});

	it.skipIf(!process.env.CI && !dockerUp)(
		"runs a docker sandbox that keeps cwd and exports, and restores it from the Worker",
		async () => {
			const h = await startHost({ drivers: ["docker"] });
			expect(h.host.drivers).toEqual(["docker"]);
			const sb = await start(h, { template: { driver: "docker" } });
			await exec(h, sb.id, "mkdir -p /tmp/w && cd /tmp/w && export X=42");
			await exec(h, sb.id, "echo data > file");
			expect((await exec(h, sb.id, "pwd; echo $X")).output).toBe(
				"/tmp/w\n42\n",
			);
			const slow = await exec(h, sb.id, "sleep 20", { timeoutMs: 500 });
			expect(slow).toMatchObject({ timedOut: true, exitCode: 124 });
			const task = taskName("host-docker");
			const state = "f".repeat(64);
			const snap = await signed(h, "POST", `/sandboxes/${sb.id}/snapshot`, {
				task,
				state,
			});
			expect(snap.status, JSON.stringify(snap.json)).toBe(200);
			const { snapshotMs: _, ...ref } = snap.json as SnapshotResponse;
			const restored = await start(h, {
				template: { driver: "docker" },
				restore: { task, state, ref },
			});
			expect(restored.source).toBe("restore");
			expect((await exec(h, restored.id, "cat /tmp/w/file")).output).toBe(
				"data\n",
			);
			// A container's hostname is its short id.
			const ids = [
				(await exec(h, sb.id, "hostname")).output.trim(),
				(await exec(h, restored.id, "hostname")).output.trim(),
			];
			const running = (id: string) =>
				execFileSync("docker", ["ps", "-aq", "--filter", `id=${id}`], {
					encoding: "utf8",
				}).trim();
			for (const id of ids) expect(running(id)).not.toBe("");
			await h.host.stop();
			for (const id of ids) expect(running(id)).toBe("");
		},
		120_000,
	);
});

describe("the driver registry", () => {
	async function drivers(extra: Partial<DriverConfig> = {}) {
		const config: DriverConfig = {
			dataDir: await tmp("registry"),
			instance: taskName("registry"),
			maxOutputBytes: 1 << 20,
			execTimeoutMs: 60_000,
			workspace: { isolate: "none", seeds: { hello: seedDir } },
			...extra,
		};
		return (await loadDrivers(config, ["workspace", "sqlite"])).drivers;
	}

	it("knows only the templates it was configured with, not names every object inherits", async () => {
		const loaded = await drivers();
		for (const driver of ["workspace", "sqlite"] as const)
			for (const name of ["constructor", "__proto__", "toString"])
				expect(
					() => loaded.get(driver)!.factory({ driver, name }),
					`${driver} ${name}`,
				).toThrow(UnknownTemplateError);
		expect(
			loaded.get("workspace")!.factory({ driver: "workspace", name: "hello" }),
		).toBeDefined();
	});

	it("reports a workspace call stopped by its own shorter time limit as timed out", async () => {
		const workspace = (await drivers()).get("workspace")!;
		const sandbox = await workspace.factory({ driver: "workspace" }).start();
		const limits = { timeoutMs: 60_000, maxOutputBytes: 1 << 20 };
		const t0 = Date.now();
		const r = await workspace.exec(
			sandbox,
			{ tool: "bash", args: { cmd: "sleep 5", timeoutMs: 200 } },
			limits,
		);
		expect(Date.now() - t0).toBeLessThan(4000);
		expect(r).toMatchObject({ exitCode: 124, timedOut: true });
		// A command that exits 124 by itself did not time out.
		const own = await workspace.exec(
			sandbox,
			{ tool: "bash", args: "exit 124" },
			limits,
		);
		expect(own).toMatchObject({ exitCode: 124, timedOut: false });
		await sandbox.stop();
	});
});

describe("bin/host.ts", () => {
	it("runs a host from the command line, prints its URL and id, and stops on SIGTERM", async () => {
		const child = spawn(
			path.join(REPO_ROOT, "node_modules", ".bin", "tsx"),
			[
				"bin/host.ts",
				"--worker",
				stack.url,
				"--key",
				stack.hostKey,
				"--capacity",
				"3",
				"--drivers",
				"workspace",
				"--name",
				"cli-host",
			],
			{ cwd: REPO_ROOT, stdio: ["ignore", "pipe", "pipe"] },
		);
		let out = "";
		child.stdout.on("data", (c: Buffer) => (out += c.toString()));
		child.stderr.on("data", (c: Buffer) => (out += c.toString()));
		const exited = new Promise<number | null>((resolve) =>
			child.on("exit", resolve),
		);
		try {
			await vi.waitFor(() => expect(out).toMatch(/^host \S+ at http/m), {
				timeout: 30_000,
				interval: 100,
			});
			const [, id, url] = /^host (\S+) at (\S+)/m.exec(out)!;
			expect(await listed(id)).toMatchObject({
				url,
				name: "cli-host",
				capacity: 3,
				drivers: ["workspace"],
			});
		} finally {
			child.kill("SIGTERM");
		}
		expect(await exited).toBe(0);
	});
});
