/**
 * The local stack as a user meets it: `trellis dev` printing a key that
 * works and starting a container host beside the Worker, the `stats` and
 * `keys` subcommands, restarts that keep state, and a `stop()` that leaves
 * no process behind.
 */
import { spawn, execFile } from "node:child_process";
import path from "node:path";
import { createServer, type AddressInfo } from "node:net";
import { promisify } from "node:util";
import { afterAll, describe, expect, it } from "vitest";
import { freePort, REPO_ROOT, startLocalStack } from "../../bin/local-stack.ts";
import { ROOT_ID, TrellisClient, TrellisError } from "../../client/index.ts";
import { cleanTmp, taskName, tmp } from "./helpers.ts";

const TSX = path.join(REPO_ROOT, "node_modules", ".bin", "tsx");
const CLI = path.join(REPO_ROOT, "bin", "trellis.ts");
const run = promisify(execFile);

afterAll(cleanTmp);

function alive(pgid: number): boolean {
	try {
		process.kill(-pgid, 0);
		return true;
	} catch {
		return false;
	}
}

describe("trellis dev", () => {
	it("prints a URL and a trainer key that work, starts a registered container host, and stops everything on Ctrl-C", async () => {
		const persist = await tmp("cli-state");
		const port = await freePort();
		const child = spawn(
			TSX,
			[CLI, "dev", "--persist-to", persist, "--port", String(port)],
			{
				cwd: REPO_ROOT,
				stdio: ["ignore", "pipe", "pipe"],
				// Its own group, as a terminal's foreground job is: Ctrl-C goes to it.
				detached: true,
			},
		);
		let out = "";
		child.stdout.on("data", (c: Buffer) => (out += c.toString()));
		child.stderr.on("data", (c: Buffer) => (out += c.toString()));
		const exited = new Promise<number | null>((resolve) =>
			child.on("exit", (code) => resolve(code)),
		);
		try {
			const deadline = Date.now() + 90_000;
			while (!out.includes("Press Ctrl-C to stop.")) {
				if (Date.now() > deadline || child.exitCode !== null)
					throw new Error(`trellis dev did not come up:\n${out}`);
				await new Promise((r) => setTimeout(r, 100));
			}
			const url = /export TRELLIS_URL=(\S+)/.exec(out)?.[1];
			const key = /export TRELLIS_KEY=(\S+)/.exec(out)?.[1];
			expect(url).toBe(`http://127.0.0.1:${port}`);
			expect(key).toBeTruthy();

			// The printed key records and looks up in the printed project.
			const client = new TrellisClient({ url: url!, key: key! });
			const task = taskName("cli");
			const call = { tool: "bash", args: { cmd: "ls" } };
			await client.record(task, {
				from: ROOT_ID,
				calls: [{ ...call, output: "a\n", execMs: 1 }],
			});
			expect(await client.lookup(task, { call, history: [] })).toMatchObject({
				status: "hit",
				output: "a\n",
			});

			// A host runs beside it, registered with the dev project's host
			// key, so managed rollouts work at once; the demo is announced.
			const hostUrl = /A container host runs beside it at (\S+)/.exec(out)?.[1];
			expect(hostUrl).toMatch(/^http:\/\/127\.0\.0\.1:\d+$/);
			expect(out).toMatch(/drivers\s+workspace, sqlite/);
			expect(out).toContain("npm run demo");
			const listed = (await (
				await fetch(`${url}/v1/hosts`, {
					headers: { authorization: `Bearer ${key}` },
				})
			).json()) as {
				hosts: { url: string; status: string; drivers: string[] }[];
			};
			expect(listed.hosts).toContainEqual(
				expect.objectContaining({
					url: hostUrl,
					status: "up",
					drivers: expect.arrayContaining(["workspace", "sqlite"]),
				}),
			);
			const rollout = await client.openRollout(task, {
				template: { driver: "workspace" },
			});
			const ran = await client.rolloutCall(task, rollout.id, {
				tool: "bash",
				args: { cmd: "echo managed" },
			});
			expect(ran).toMatchObject({ hit: false, output: "managed\n" });
			await client.closeRollout(task, rollout.id);

			// So does the printed curl example, run as printed.
			const curl = /Try it:\n([\s\S]+?)\n\n/.exec(out)?.[1];
			expect(curl).toContain("curl");
			const { stdout } = await run("bash", ["-c", curl!], {
				env: { ...process.env, TRELLIS_URL: url, TRELLIS_KEY: key },
			});
			expect(JSON.parse(stdout)).toMatchObject({ status: "miss", depth: 0 });

			process.kill(-child.pid!, "SIGINT");
			expect(await exited).toBe(0);
			expect(out).toContain("Stopping");
			const gone = await client.health().then(
				() => false,
				(err: unknown) =>
					err instanceof TrellisError && err.code === "network_error",
			);
			expect(gone).toBe(true);
			// The host stopped with it.
			const hostGone = await fetch(`${hostUrl}/health`).then(
				() => false,
				() => true,
			);
			expect(hostGone).toBe(true);
		} finally {
			if (child.exitCode === null) process.kill(-child.pid!, "SIGKILL");
		}
	});
});

describe("startLocalStack", () => {
	it("fails on a port the caller asked for that is taken, rather than moving elsewhere", async () => {
		const taken = createServer();
		await new Promise<void>((r) => taken.listen(0, "127.0.0.1", r));
		const { port } = taken.address() as AddressInfo;
		try {
			await expect(
				startLocalStack({ port, persistTo: await tmp("taken-state") }),
			).rejects.toThrow(/Address already in use/);
		} finally {
			taken.close();
		}
	});

	it("keeps what was recorded and its keys across a restart over the same directory, and stop() leaves no process", async () => {
		const persist = await tmp("restart-state");
		const task = taskName("restart");
		const call = { tool: "bash", args: { cmd: "make" } };

		const first = await startLocalStack({ persistTo: persist });
		const c1 = new TrellisClient({ url: first.url, key: first.trainerKey });
		await c1.record(task, {
			from: ROOT_ID,
			calls: [{ ...call, output: "built\n", execMs: 9 }],
		});
		await first.stop();
		expect(alive(first.pid)).toBe(false);

		// The project exists already: the second start must take the 409 in stride.
		const second = await startLocalStack({ persistTo: persist });
		try {
			const c2 = new TrellisClient({ url: second.url, key: second.trainerKey });
			expect(await c2.lookup(task, { call, history: [] })).toMatchObject({
				status: "hit",
				output: "built\n",
			});
			// The keys live in the same D1 and are saved beside it: a restart
			// hands out the same ones.
			expect([second.trainerKey, second.hostKey]).toEqual([
				first.trainerKey,
				first.hostKey,
			]);
		} finally {
			await second.stop();
		}
		expect(alive(second.pid)).toBe(false);
	});

	it("serves `trellis stats` and `trellis keys create` against a running stack", async () => {
		const stack = await startLocalStack({
			persistTo: await tmp("subcommands-state"),
		});
		try {
			const task = taskName("stats");
			const client = new TrellisClient({
				url: stack.url,
				key: stack.trainerKey,
			});
			await client.record(task, {
				from: ROOT_ID,
				calls: [{ tool: "bash", args: "ls", output: "", execMs: 1 }],
			});
			const env = {
				...process.env,
				TRELLIS_URL: stack.url,
				TRELLIS_KEY: stack.trainerKey,
			};
			const stats = await run(TSX, [CLI, "stats", task], {
				cwd: REPO_ROOT,
				env,
			});
			expect(JSON.parse(stats.stdout)).toMatchObject({
				task,
				nodes: expect.any(Number),
			});

			const adminEnv = { ...env, TRELLIS_KEY: stack.adminKey };
			const made = await run(
				TSX,
				[CLI, "keys", "create", "--role", "host", "--project", stack.project],
				{
					cwd: REPO_ROOT,
					env: adminEnv,
				},
			);
			const key = JSON.parse(made.stdout) as { key: string; role: string };
			expect(key.role).toBe("host");
			// A host key may read stats but not record.
			const host = new TrellisClient({ url: stack.url, key: key.key });
			expect((await host.stats(task)).task).toBe(task);
		} finally {
			await stack.stop();
		}
	});
});
