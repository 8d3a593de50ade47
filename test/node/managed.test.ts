/**
 * Managed mode end to end: a real `wrangler dev` (Worker, Durable Objects, D1,
 * R2), two real container hosts on loopback, rollouts driven over HTTP.
 * Shell commands append their name to a log outside the sandboxes, so the
 * tests count what really ran, not what the server says ran.
 */
import { execFileSync, spawn } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { startLocalStack, type LocalStack } from "../../bin/local-stack.ts";
import { TrellisClient } from "../../client/http.ts";
import type { GraphNode } from "../../core/api.ts";
import type { Template } from "../../core/host-api.ts";
import type { RolloutCallResponse } from "../../core/managed-api.ts";
import { createHost, type Host } from "../../host/server.ts";
import { cleanTmp, countLines, taskName, tmp } from "./helpers.ts";

let stack: LocalStack;
let client: TrellisClient;
const hosts: Host[] = [];
// Made now, not in beforeAll: the calls below embed the path when the module loads.
const logDir = mkdtempSync(path.join(tmpdir(), "trellis-managed-log-"));
const log = path.join(logDir, "ran.log");

const dockerUp = (() => {
	try {
		execFileSync("docker", ["info"], { stdio: "ignore", timeout: 10_000 });
		return true;
	} catch {
		return false;
	}
})();

async function startHost(name: string): Promise<Host> {
	const host = createHost({
		worker: stack.url,
		key: stack.hostKey,
		name,
		dataDir: await tmp(`host-${name}`),
		drivers: dockerUp
			? ["workspace", "sqlite", "docker"]
			: ["workspace", "sqlite"],
		// Commands log outside their sandboxes, so the test can count them.
		templates: { workspace: { binds: [logDir] } },
		log: () => undefined,
	});
	await host.start();
	hosts.push(host);
	return host;
}

beforeAll(async () => {
	stack = await startLocalStack({
		persistTo: await tmp("managed-state"),
		// Cheap sandboxes by assumption, so a call of a few hundred ms is worth
		// a snapshot; one warm root and one warm fork per snapshot.
		vars: { SANDBOX_COST_PRIOR_MS: "100", WARM_ROOTS: "1", WARM_FORKS: "1" },
	});
	client = new TrellisClient({ url: stack.url, key: stack.trainerKey });
	await startHost("h1");
	await startHost("h2");
});

afterAll(async () => {
	for (const h of hosts) await h.stop();
	await stack?.stop();
	await cleanTmp();
	rmSync(logDir, { recursive: true, force: true });
});

const workspace: Template = { driver: "workspace" };

/** A shell call that logs its name outside the sandbox, then runs `cmd`. */
const sh = (name: string, cmd: string, mutates?: boolean) => ({
	tool: "bash",
	args: { cmd: `echo ${name} >> "${log}"; ${cmd}` },
	...(mutates === undefined ? {} : { mutates }),
});
const ran = (name: string) => countLines(log, name);

async function rollout(
	task: string,
	template: Template = workspace,
	oracle = false,
) {
	const r = await client.openRollout(task, { template, oracle });
	const call = (c: Parameters<TrellisClient["rolloutCall"]>[2]) =>
		client.rolloutCall(task, r.id, c);
	return { id: r.id, call, close: () => client.closeRollout(task, r.id) };
}

const M1 = sh(
	"clone",
	"mkdir -p repo && echo 'print(1)' > repo/foo.py && echo cloned",
);
const M2 = sh("patch", "echo 'print(2)' > repo/foo.py && echo patched");
const M3 = sh("build", "sha256sum repo/foo.py > repo/sum && cat repo/sum");
const CAT = sh("cat", "cat repo/foo.py", false);

/** Sets the stack's project budgets as its admin. */
async function putBudgets(budgets: Record<string, number>): Promise<void> {
	const res = await fetch(`${stack.url}/v1/projects/${stack.project}/budgets`, {
		method: "PUT",
		headers: {
			authorization: `Bearer ${stack.adminKey}`,
			"content-type": "application/json",
		},
		body: JSON.stringify(budgets),
	});
	expect(res.status).toBe(200);
}

describe("managed rollouts", () => {
	// First in the file: the project holds nothing yet, so a quota of one
	// byte lets records through and refuses any snapshot blob.
	it("records a call whose snapshot the project's quota refuses, without the snapshot, and keeps the host", async () => {
		const task = taskName("refused");
		const SLOW = sh("refused-slow", "sleep 0.5; echo built > a && echo done");
		await putBudgets({ projectBytes: 1 });
		try {
			const a = await rollout(task);
			const first = await a.call(SLOW);
			expect(first).toMatchObject({
				output: "done\n",
				exitCode: 0,
				hit: false,
			});
			// The host was not dropped for the refusal: the rollout goes on in
			// its sandbox.
			const next = await a.call(sh("refused-next", "cat a"));
			expect(next.output).toBe("built\n");
			expect(next.plan).toEqual({ kind: "live", from: 1, replayed: 0 });
			await a.close();

			const page = await client.graph(task);
			const slow = page.nodes.find((n: GraphNode) =>
				JSON.stringify(n.args).includes("refused-slow"),
			)!;
			// The rule wanted a snapshot; the quota refused its blob.
			expect(slow.policy).toMatchObject({ snapshot: true });
			expect(slow.snapshot).toBeNull();
			expect((await client.stats(task)).snapshots).toBe(0);
		} finally {
			// No overrides: the Worker's defaults again.
			await putBudgets({});
		}
		// With no snapshot to restore, a later miss below it replays the call.
		const b = await rollout(task);
		expect((await b.call(SLOW)).hit).toBe(true);
		const miss = await b.call(sh("refused-after", "cat a"));
		expect(miss.output).toBe("built\n");
		expect(miss.plan).toMatchObject({ from: 0, replayed: 1 });
		expect(await ran("refused-slow")).toBe(2);
		await b.close();
	});

	it("runs a GRPO group's identical first call once; the others are coalesced hits", async () => {
		const task = taskName("group");
		const slow = sh(
			"group-first",
			"sleep 1; echo ready > state && echo started",
		);
		const group = await Promise.all(
			Array.from({ length: 4 }, () => rollout(task)),
		);
		const replies = await Promise.all(group.map((r) => r.call(slow)));
		expect(await ran("group-first")).toBe(1);
		expect(replies.filter((r) => !r.hit)).toHaveLength(1);
		for (const r of replies) expect(r.output).toBe("started\n");
		const coalesced = replies.filter((r) => r.coalesced).length;
		expect(coalesced).toBeGreaterThan(0);
		const stats = await client.stats(task);
		expect(stats.coalesced).toBe(coalesced);
		// The rollouts diverge. The one that ran the call has its sandbox; each
		// coalesced one was handed a fork of it: nobody replays the prefix.
		const diverged = await Promise.all(
			group.map((r, i) => r.call(sh(`diverge-${i}`, `cat state && echo ${i}`))),
		);
		for (const [i, d] of diverged.entries()) {
			expect(d.output).toBe(`ready\n${i}\n`);
			if (replies[i].coalesced)
				expect(d.plan).toEqual({ kind: "live", from: 1, replayed: 0 });
		}
		expect(await ran("group-first")).toBe(1);
		for (const r of group) await r.close();
	});

	it("answers a recorded path with hits and runs nothing; the cat before and after a patch differ", async () => {
		const task = taskName("hits");
		const a = await rollout(task);
		const first = [
			await a.call(M1),
			await a.call(CAT),
			await a.call(M2),
			await a.call(CAT),
		];
		expect(first.map((r) => r.hit)).toEqual([false, false, false, false]);
		expect(first[1].output).toBe("print(1)\n");
		expect(first[3].output).toBe("print(2)\n");
		// The rollout's own sandbox carried it along: nothing was replayed.
		expect(first.map((r) => r.plan?.replayed)).toEqual([0, 0, 0, 0]);

		const before = {
			clone: await ran("clone"),
			patch: await ran("patch"),
			cat: await ran("cat"),
		};
		// The first rollout's commands did log: counting them can tell.
		expect(before.clone * before.patch * before.cat).toBeGreaterThan(0);
		const b = await rollout(task);
		const second = [
			await b.call(M1),
			await b.call(CAT),
			await b.call(M2),
			await b.call(CAT),
		];
		expect(second.map((r) => r.hit)).toEqual([true, true, true, true]);
		expect(second.map((r) => r.output)).toEqual(first.map((r) => r.output));
		expect(second.reduce((s, r) => s + r.savedMs, 0)).toBeGreaterThan(0);
		expect({
			clone: await ran("clone"),
			patch: await ran("patch"),
			cat: await ran("cat"),
		}).toEqual(before);
		await a.close();
		await b.close();
	});

	it("misses at every depth, replaying exactly the calls below where it resumes", async () => {
		const task = taskName("depths");
		const a = await rollout(task);
		const path = [M1, M2, M3];
		for (const c of path) await a.call(c);
		await a.close();
		for (let k = 0; k <= path.length; k++) {
			const r = await rollout(task);
			for (const c of path.slice(0, k))
				expect((await r.call(c)).hit).toBe(true);
			const before = await Promise.all(["clone", "patch", "build"].map(ran));
			const miss = await r.call(sh(`new-${k}`, "ls repo 2>/dev/null | wc -l"));
			expect(miss.hit).toBe(false);
			expect(miss.plan).toMatchObject({ kind: "fresh", from: 0, replayed: k });
			const after = await Promise.all(["clone", "patch", "build"].map(ran));
			expect(after.map((n, i) => n - before[i])).toEqual(
				[0, 1, 2].map((i) => (i < k ? 1 : 0)),
			);
			expect(await ran(`new-${k}`)).toBe(1);
			await r.close();
		}
	});

	it("skips stateless calls when matching, in any order", async () => {
		const task = taskName("stateless");
		const LS = sh("ls", "ls repo", false);
		const a = await rollout(task);
		for (const c of [M1, CAT, M2, LS]) await a.call(c);
		const b = await rollout(task);
		const replies = [
			await b.call(LS),
			await b.call(M1),
			await b.call(M2),
			await b.call(LS),
		];
		// LS at the root is a different result (nothing was cloned yet): a miss.
		expect(replies.map((r) => r.hit)).toEqual([false, true, true, true]);
		expect(replies[3].output).toBe("foo.py\n");
		await a.close();
		await b.close();
	});

	it("snapshots a slow state, shows the decision in the graph, and restores it instead of replaying", async () => {
		const task = taskName("snapshot");
		const SLOW = sh(
			"slow",
			"sleep 0.5; mkdir -p out && echo built > out/a && echo done",
		);
		const FAST = sh("fast", "echo fast > out/b");
		const a = await rollout(task);
		await a.call(SLOW);
		await a.call(FAST);
		await a.close();

		const page = await client.graph(task);
		const node = (needle: string) =>
			page.nodes.find((n: GraphNode) =>
				JSON.stringify(n.args).includes(needle),
			)!;
		expect(node("slow").policy).toMatchObject({ snapshot: true });
		expect(node("slow").policy!.replayMs).toBeGreaterThan(
			node("slow").policy!.costMs,
		);
		expect(node("slow").snapshot).toMatchObject({ driver: "workspace" });
		expect(node("fast").policy).toMatchObject({ snapshot: false });
		expect(node("fast").snapshot).toBeNull();

		const b = await rollout(task);
		expect((await b.call(SLOW)).hit).toBe(true);
		const miss = await b.call(sh("after-slow", "cat out/a"));
		expect(miss.output).toBe("built\n");
		expect(["restore", "warm"]).toContain(miss.plan!.kind);
		expect(miss.plan).toMatchObject({ from: 1, replayed: 0 });
		expect(await ran("slow")).toBe(1);
		await b.close();
	});

	it("checks hits against a fresh full replay in oracle mode, and catches a nondeterministic tool", async () => {
		const task = taskName("oracle");
		const DATE = sh("nanos", "date +%N", false);
		const a = await rollout(task);
		for (const c of [M1, M2, CAT, DATE]) await a.call(c);
		await a.close();

		const o = await rollout(task, workspace, true);
		const replies: RolloutCallResponse[] = [];
		for (const c of [M1, M2, CAT]) replies.push(await o.call(c));
		expect(replies.map((r) => [r.hit, r.oracle?.match])).toEqual([
			[true, true],
			[true, true],
			[true, true],
		]);
		const nanos = await o.call(DATE);
		expect(nanos.hit).toBe(true);
		expect(nanos.oracle).toEqual({ match: false });
		const stats = await client.stats(task);
		expect(stats.oracle).toEqual({ checks: 4, mismatches: 1 });
		expect(stats.tools.bash.oracleMismatches).toBe(1);
		await o.close();
	});

	it("runs real SQL on Chinook, treating reads as stateless without being told", async () => {
		const task = taskName("sql");
		const db: Template = { driver: "sqlite", name: "chinook" };
		const q = (query: string) => ({ tool: "sql", args: { query } });
		const count = q("SELECT COUNT(*) AS n FROM Artist");
		const a = await rollout(task, db);
		const artist = await a.call(
			q("SELECT Name FROM Artist WHERE ArtistId = 1"),
		);
		expect(artist.output).toContain("AC/DC");
		const n0 = await a.call(count);
		const insert = await a.call(
			q("INSERT INTO Artist (Name) VALUES ('Trellis')"),
		);
		const n1 = await a.call(count);
		expect(n0.output).not.toBe(n1.output);
		// Reads left the state alone; the insert moved it.
		expect(artist.state).toBe(n0.state);
		expect(insert.state).not.toBe(n0.state);
		await a.close();

		const b = await rollout(task, db);
		expect((await b.call(count)).output).toBe(n0.output);
		expect(
			(await b.call(q("INSERT INTO Artist (Name) VALUES ('Trellis')"))).hit,
		).toBe(true);
		expect((await b.call(count)).output).toBe(n1.output);
		await b.close();
	});

	it.skipIf(!dockerUp && !process.env.CI)(
		"runs a terminal session in Docker: cwd and variables carry over, and a second rollout hits",
		async () => {
			const task = taskName("docker");
			const docker: Template = { driver: "docker" };
			const calls = [
				{
					tool: "bash",
					args: { cmd: "mkdir -p /work/p && cd /work/p && export GREETING=hi" },
				},
				{ tool: "bash", args: { cmd: 'echo "$GREETING" > f && sha256sum f' } },
				{ tool: "bash", args: { cmd: "pwd && cat f" }, mutates: false },
			];
			const a = await rollout(task, docker);
			const first: RolloutCallResponse[] = [];
			for (const c of calls) first.push(await a.call(c));
			expect(first[2].output).toBe("/work/p\nhi\n");
			await a.close();
			const b = await rollout(task, docker);
			for (const [i, c] of calls.entries()) {
				const r = await b.call(c);
				expect(r.hit).toBe(true);
				expect(r.output).toBe(first[i].output);
			}
			await b.close();
		},
	);

	it("survives a host killed mid-rollout: the next call restores on another host", async () => {
		// A project of its own, so that the only hosts are the two started here.
		const admin = new TrellisClient({ url: stack.url, key: stack.adminKey });
		const project = `kill-${Date.now()}`;
		await admin.createProject(project);
		const trainer = client.withKey(
			(await admin.createKey({ project, role: "trainer" })).key,
		);
		const hostKey = (await admin.createKey({ project, role: "host" })).key;

		// The doomed host runs in a process of its own, to be SIGKILLed.
		const child = spawn(
			path.join("node_modules", ".bin", "tsx"),
			[
				"bin/host.ts",
				"--worker",
				stack.url,
				"--key",
				hostKey,
				"--drivers",
				"workspace",
				"--bind",
				logDir,
			],
			// Its own process group: tsx runs node under it, and both must die.
			{ stdio: ["ignore", "pipe", "inherit"], detached: true },
		);
		const kill = () => {
			try {
				process.kill(-child.pid!, "SIGKILL");
			} catch {
				// already gone
			}
		};
		try {
			await new Promise<void>((resolve, reject) => {
				child.stdout!.on(
					"data",
					(b: Buffer) => b.toString().includes(" at http") && resolve(),
				);
				child.once("exit", () =>
					reject(new Error("the host exited before it registered")),
				);
			});
			const task = taskName("killed");
			const r = await trainer.openRollout(task, { template: workspace });
			const call = (c: ReturnType<typeof sh>) =>
				trainer.rolloutCall(task, r.id, c);
			await call(sh("k-slow", "sleep 0.5; echo base > base && echo ok"));
			await call(sh("k-step", "echo step >> base"));

			const survivor = createHost({
				worker: stack.url,
				key: hostKey,
				name: "survivor",
				templates: { workspace: { binds: [logDir] } },
				dataDir: await tmp("host-survivor"),
				drivers: ["workspace"],
				log: () => undefined,
			});
			await survivor.start();
			hosts.push(survivor);
			const exited = new Promise((resolve) => child.once("exit", resolve));
			kill();
			await exited;

			const next = await call(sh("k-next", "cat base"));
			expect(next.output).toBe("base\nstep\n");
			expect(next.plan).toMatchObject({ from: 1, replayed: 1 });
			expect(survivor.health().sandboxes).toBe(1);
			expect(await ran("k-step")).toBe(2);
			const listed = await trainer.listHosts();
			expect(listed.find((h) => h.name === "survivor")?.status).toBe("up");
			await trainer.closeRollout(task, r.id);
		} finally {
			kill();
		}
	});

	// Last: it stops a host.
	it("moves a call to another host when the rollout's host dies, restoring across hosts", async () => {
		const task = taskName("failover");
		const SLOW = sh("fo-slow", "sleep 0.5; echo base > base && echo ok");
		const a = await rollout(task);
		await a.call(SLOW);
		const step = await a.call(sh("fo-step", "echo step >> base"));
		expect(step.hit).toBe(false);
		const victim = hosts.find((h) => h.health().sandboxes > 0)!;
		expect(victim).toBeDefined();
		await victim.stop();

		const next = await a.call(sh("fo-next", "cat base"));
		expect(next.output).toBe("base\nstep\n");
		// The step was replayed on the surviving host, after the snapshot's restore.
		expect(next.plan).toMatchObject({ from: 1, replayed: 1 });
		expect(await ran("fo-step")).toBe(2);
		expect(await ran("fo-slow")).toBe(1);
		await a.close();
	});
});
