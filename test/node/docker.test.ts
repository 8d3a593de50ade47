/**
 * The Docker driver against a real engine: real containers of the locally
 * built base image, real commits, saves and loads. Skipped only on a
 * machine with no engine and no `CI`; in CI a missing engine fails the file
 * (`.ci/docker.sh` installs and starts one).
 */
import { execFile, execFileSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { readFile, readdir, rm, writeFile } from "node:fs/promises";
import path from "node:path";
import { promisify } from "node:util";
import { gzipSync } from "node:zlib";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
	DockerEngine,
	DockerSandbox,
	dockerFactory,
	removeLabelled,
	type DockerOptions,
} from "../../host/drivers/docker.ts";
import { cleanTmp, tmp } from "./helpers.ts";

const run = promisify(execFile);

function engineUp(): boolean {
	try {
		execFileSync("docker", ["info"], { stdio: "ignore", timeout: 20_000 });
		return true;
	} catch {
		return false;
	}
}

const skip = !process.env.CI && !engineUp();

// Everything this file creates carries this label, so counts and cleanup
// see only this run's containers and images, whatever else the engine runs.
const RUN = randomBytes(6).toString("hex");
const labels = { "trellis.test": RUN };
const engine = new DockerEngine();
const sh = (cmd: string, extra: Record<string, unknown> = {}) => ({
	tool: "bash",
	args: { cmd, ...extra },
});

function factory(options: DockerOptions = {}) {
	return dockerFactory({
		...options,
		labels: { ...labels, ...options.labels },
	});
}

/** Containers and images (intermediate ones too) with the labels. */
async function counted(
	label: Record<string, string> = labels,
): Promise<{ containers: number; images: number }> {
	const filter = Object.entries(label).flatMap(([k, v]) => [
		"--filter",
		`label=${k}=${v}`,
	]);
	const lines = (s: string) => s.split("\n").filter((l) => l !== "").length;
	const ps = await run("docker", ["ps", "-aq", ...filter]);
	const images = await run("docker", ["images", "-aq", ...filter]);
	return { containers: lines(ps.stdout), images: lines(images.stdout) };
}

describe.skipIf(skip)("DockerSandbox", () => {
	beforeAll(async () => {
		// The tests start what they need: the base image, fast when built.
		await run(path.resolve(import.meta.dirname, "../../host/images/build.sh"));
	});
	afterAll(async () => {
		await removeLabelled(labels);
		await cleanTmp();
	});

	it("runs a command and returns stdout and stderr in order with its exit code", async () => {
		const sb = await factory().start();
		const r = await sb.exec(
			sh("echo one; echo two >&2; echo three; pwd; exit 7"),
		);
		expect(r.output).toBe("one\ntwo\nthree\n/work\n");
		expect(r.exitCode).toBe(7);
		expect(r.execMs).toBeGreaterThan(0);
		expect(r.timedOut).toBe(false);
		const plain = await sb.exec({ tool: "bash", args: "echo hi | sha256sum" });
		expect(plain).toMatchObject({
			output:
				"98ea6e4f216f2fb4b69fff9b3a44842c38686ca685f3f55dc48c5d3fb1107be4  -\n",
			exitCode: 0,
		});
		expect((await sb.exec(sh("false"))).exitCode).toBe(1);
		await expect(sb.exec({ tool: "sql", args: "select 1" })).rejects.toThrow(
			/does not run tool sql/,
		);
		await sb.stop();
	});

	it("keeps the working directory and exported variables for the next exec, unsets and exits included", async () => {
		const sb = await factory().start();
		const first = await sb.exec(sh("cd /tmp && export X=1"));
		expect(first).toMatchObject({ output: "", exitCode: 0 });
		expect((await sb.exec(sh("pwd; echo $X"))).output).toBe("/tmp\n1\n");
		// A command that leaves by `exit` still leaves its state behind.
		const left = await sb.exec(sh("cd /etc; export Y='a b'; unset X; exit 3"));
		expect(left.exitCode).toBe(3);
		expect((await sb.exec(sh('pwd; echo "[$X][$Y]"'))).output).toBe(
			"/etc\n[][a b]\n",
		);
		// A call's cwd is relative to the workdir, and moves the shell there.
		await sb.exec(sh("mkdir -p /work/sub/dir"));
		expect((await sb.exec(sh("pwd", { cwd: "sub/dir" }))).output).toBe(
			"/work/sub/dir\n",
		);
		expect((await sb.exec(sh("pwd"))).output).toBe("/work/sub/dir\n");
		// A directory that vanished sends the next command to the workdir.
		await sb.exec(sh("mkdir /tmp/gone && cd /tmp/gone && rmdir /tmp/gone"));
		expect((await sb.exec(sh("pwd"))).output).toBe("/work\n");
		await sb.stop();
	});

	it("runs execs called at once one after another, so no state change is lost", async () => {
		const sb = await factory().start();
		await Promise.all([
			sb.exec(sh("sleep 0.2; cd /tmp && export A=1")),
			sb.exec(sh("export B=2")),
			sb.exec(sh("export C=3")),
		]);
		expect((await sb.exec(sh("pwd; echo $A$B$C"))).output).toBe("/tmp\n123\n");
		await sb.stop();
	});

	it("gives a container no network unless the template asks for one", async () => {
		const interfaces = async (network: boolean) => {
			const sb = await factory({ network }).start();
			const r = await sb.exec(sh("tail -n +3 /proc/net/dev | cut -d: -f1"));
			await sb.stop();
			return r.output
				.split("\n")
				.map((l) => l.trim())
				.filter(Boolean)
				.sort();
		};
		expect(await interfaces(false)).toEqual(["lo"]);
		expect(await interfaces(true)).toEqual(["eth0", "lo"]);
	});

	it("kills a command at its timeout, background jobs included, exits 124 and stays usable", async () => {
		const sb = await factory({ timeoutMs: 500 }).start();
		const t0 = Date.now();
		const r = await sb.exec(sh("sleep 30 & sleep 31; echo never"));
		expect(Date.now() - t0).toBeLessThan(5000);
		expect(r.exitCode).toBe(124);
		expect(r.timedOut).toBe(true);
		expect(r.output).toBe("\n[timed out after 500 ms]\n");
		// No sleep survives; the per-call limit overrides the sandbox's.
		const ps = await sb.exec(sh("sleep 1; ps -o args"), { timeoutMs: 5000 });
		expect(ps.exitCode).toBe(0);
		expect(ps.output).not.toMatch(/sleep 3[01]/);
		await sb.stop();
	});

	it("takes the shorter of the call's own time limit and the one the host passes", async () => {
		const sb = await factory().start();
		const t0 = Date.now();
		const own = await sb.exec(sh("sleep 5", { timeoutMs: 200 }), {
			timeoutMs: 60_000,
		});
		// Generous: the kill is an exec of its own, and the engine is shared.
		expect(Date.now() - t0).toBeLessThan(4000);
		expect(own).toMatchObject({
			exitCode: 124,
			timedOut: true,
			output: "\n[timed out after 200 ms]\n",
		});
		const t1 = Date.now();
		const host = await sb.exec(sh("sleep 5", { timeoutMs: 60_000 }), {
			timeoutMs: 200,
		});
		expect(Date.now() - t1).toBeLessThan(4000);
		expect(host).toMatchObject({ exitCode: 124, timedOut: true });
		await sb.stop();
	});

	it("cuts the output at the size cap and says how much it dropped", async () => {
		const sb = await factory({ maxOutputBytes: 64 }).start();
		const r = await sb.exec(sh("head -c 1000 /dev/zero | tr '\\0' a"));
		expect(r.output).toBe(
			`${"a".repeat(64)}\n[output truncated: 936 more bytes]\n`,
		);
		expect(r.droppedBytes).toBe(936);
		expect(r.exitCode).toBe(0);
		const big = await sb.exec(sh("echo 12345"), { maxOutputBytes: 3 });
		expect(big.output).toBe("123\n[output truncated: 3 more bytes]\n");
		await sb.stop();
	});

	it("forks into an independent copy in the same state without pausing the source", async () => {
		const f = factory();
		const a = await f.start();
		// Enough data that the commit takes a while, for the poll to see it.
		await a.exec(
			sh(
				"head -c 33554432 /dev/urandom > /work/big && echo v1 > /work/f && cd /work && export K=k",
			),
		);
		let forked = false;
		let polls = 0;
		let paused = 0;
		const poll = (async () => {
			while (!forked) {
				const info = await engine.inspectContainer(a.containerId);
				polls++;
				if (info.State.Paused || !info.State.Running) paused++;
			}
		})();
		const b = await a.fork().finally(() => {
			forked = true;
		});
		await poll;
		expect(polls).toBeGreaterThan(1);
		expect(paused).toBe(0);
		expect(b.containerId).not.toBe(a.containerId);
		expect((await b.exec(sh("pwd; echo $K; cat f"))).output).toBe(
			"/work\nk\nv1\n",
		);
		await b.exec(sh("echo v2 > f; rm big"));
		await a.exec(sh("echo a > only-a"));
		expect((await a.exec(sh("cat f; ls"))).output).toBe("v1\nbig\nf\nonly-a\n");
		expect((await b.exec(sh("cat f; ls"))).output).toBe("v2\nf\n");
		await Promise.all([a.stop(), b.stop()]);
	});

	it("flattens a fork past the layer limit and keeps its state", async () => {
		const f = factory({ maxLayers: 2 });
		const a = await f.start();
		await a.exec(sh("echo deep > /work/d && cd /tmp"));
		const b = await a.fork();
		const c = await b.fork();
		const layers = async (sb: DockerSandbox) => {
			const info = await engine.inspectContainer(sb.containerId);
			return (await engine.inspectImage(info.Image)).RootFS.Layers?.length;
		};
		expect(await layers(a)).toBe(1);
		expect(await layers(b)).toBe(2);
		expect(await layers(c)).toBe(1);
		expect((await c.exec(sh("pwd; cat /work/d"))).output).toBe("/tmp\ndeep\n");
		await Promise.all([a.stop(), b.stop(), c.stop()]);
	});

	it("restores a snapshot in another factory's sandbox with its files, directory and environment", async () => {
		const a = await factory().start();
		await a.exec(
			sh(
				"mkdir -p /work/src && echo hello > /work/src/x && cd src && export V=7",
			),
		);
		const snap = await a.snapshot();
		expect(snap.driver).toBe("docker");
		// A gzipped image archive.
		expect([...snap.data.subarray(0, 2)]).toEqual([0x1f, 0x8b]);
		await a.stop();
		const source = {
			ref: { driver: "docker" } as never,
			read: async () => snap.data,
		};

		const other = factory();
		const b = await other.restore(source);
		expect((await b.exec(sh("pwd; echo $V; cat x"))).output).toBe(
			"/work/src\n7\nhello\n",
		);
		// Restoring into a live sandbox replaces what it had.
		const c = await other.start();
		await c.exec(sh("echo stale > /work/stale"));
		await c.restore(source);
		expect((await c.exec(sh("pwd; ls /work"))).output).toBe("/work/src\nsrc\n");
		await expect(
			c.restore({ ref: { driver: "workspace" } as never, read: source.read }),
		).rejects.toThrow(/cannot restore a workspace snapshot/);
		await Promise.all([b.stop(), c.stop()]);
	});

	it("leaves the template's layers out of a snapshot unless asked for a whole archive", async () => {
		const thin = factory();
		const whole = factory({ thinSnapshots: false, compress: false });
		const a = await thin.start();
		const b = await whole.start();
		for (const sb of [a, b]) await sb.exec(sh("echo kept > /work/k && cd /"));
		const small = await a.snapshot();
		const big = await b.snapshot();
		await Promise.all([a.stop(), b.stop()]);
		// The base layer is a 2 MB busybox; the commands wrote a few bytes.
		expect(small.data.length).toBeLessThan(64 << 10);
		expect(big.data.length).toBeGreaterThan(1 << 20);
		// An uncompressed tar ("ustar" at offset 257).
		expect(Buffer.from(big.data.subarray(257, 262)).toString()).toBe("ustar");
		for (const data of [small.data, big.data]) {
			const sb = await thin.restore({
				ref: { driver: "docker" } as never,
				read: async () => data,
			});
			expect((await sb.exec(sh("pwd; cat /work/k"))).output).toBe("/\nkept\n");
			await sb.stop();
		}
	});

	it("says so when a thin snapshot's template image is missing on the restoring engine", async () => {
		// A template of its own, so removing it takes its layer away.
		const base = await factory().start();
		// Big enough to be worth leaving out (small layers always go in).
		await base.exec(
			sh(
				"echo template > /etc/template && head -c 200000 /dev/urandom > /etc/r",
			),
		);
		const template = `trellis-test-template:${RUN}`;
		await run("docker", ["commit", base.containerId, template]);
		await base.stop();
		const f = factory({ image: template });
		const a = await f.start();
		expect((await a.exec(sh("cat /etc/template"))).output).toBe("template\n");
		const snap = await a.snapshot();
		await a.stop();
		await run("docker", ["rmi", template]);
		await expect(
			f.restore({
				ref: { driver: "docker" } as never,
				read: async () => snap.data,
			}),
		).rejects.toThrow(/leaves out its template image's layers/);
	});

	it("refuses a snapshot archive that names images, and leaves the template's tag where it was", async () => {
		// `docker load` tags what an archive names: a crafted snapshot naming
		// the template would swap the image every fresh sandbox runs. The
		// template here is a tag of the test's own, so that a driver that
		// lets the load through moves no tag anything else uses.
		const template = `trellis-test-template:tags-${RUN}`;
		await run("docker", ["tag", "trellis-base:latest", template]);
		const evil = `trellis-test-evil:${RUN}`;
		const dir = await tmp("docker-tags");
		try {
			const templateId = (await engine.inspectImage(template)).Id;
			const f = factory({ image: template });
			const sb = await f.start();
			await sb.exec(sh("echo evil > /etc/evil"));
			await run("docker", ["commit", sb.containerId, evil]);
			await sb.stop();
			const saved = path.join(dir, "saved");
			await run("mkdir", [saved]);
			await run("sh", [
				"-c",
				`docker save "$1" | tar -x -C "$2"`,
				"sh",
				evil,
				saved,
			]);
			await run("docker", ["rmi", evil]);
			const [repo, tag] = template.split(":");
			const manifestFile = path.join(saved, "manifest.json");
			const manifest = JSON.parse(await readFile(manifestFile, "utf8"));
			const repositories = JSON.parse(
				await readFile(path.join(saved, "repositories"), "utf8"),
			);
			const layer = Object.values(
				Object.values(repositories)[0] as Record<string, string>,
			)[0];
			/** The saved archive with its names replaced: a tar of `saved`. */
			const crafted = async (
				names: { manifest?: boolean; repositories?: boolean },
				gzip = false,
			): Promise<Uint8Array> => {
				if (names.manifest !== undefined)
					await writeFile(
						manifestFile,
						JSON.stringify([
							{ ...manifest[0], RepoTags: names.manifest ? [template] : null },
						]),
					);
				else await rm(manifestFile, { force: true });
				const reposFile = path.join(saved, "repositories");
				if (names.repositories)
					await writeFile(
						reposFile,
						JSON.stringify({ [repo!]: { [tag!]: layer } }),
					);
				else await rm(reposFile, { force: true });
				const out = path.join(dir, "crafted.tar");
				await run("tar", ["-cf", out, "-C", saved, ...(await readdir(saved))]);
				const data = await readFile(out);
				return gzip ? gzipSync(data) : data;
			};
			const restore = (data: Uint8Array) =>
				f.restore({
					ref: { driver: "docker" } as never,
					read: async () => data,
				});
			// RepoTags in manifest.json, plain and gzipped as snapshots are.
			for (const gzip of [false, true])
				await expect(
					restore(await crafted({ manifest: true }, gzip)),
				).rejects.toThrow(/names images/);
			// The legacy `repositories` file, which a load without a manifest reads.
			await expect(
				restore(await crafted({ repositories: true })),
			).rejects.toThrow(/names images/);
			await expect(
				restore(await crafted({ manifest: false, repositories: true })),
			).rejects.toThrow(/names images/);
			expect((await engine.inspectImage(template)).Id).toBe(templateId);
			// The same archive naming nothing is an ordinary snapshot.
			const plain = await restore(await crafted({ manifest: false }, true));
			expect((await plain.exec(sh("cat /etc/evil"))).output).toBe("evil\n");
			await plain.stop();
			expect((await engine.inspectImage(template)).Id).toBe(templateId);
		} finally {
			await run("docker", ["rmi", template]).catch(() => {});
		}
	});

	it("stop removes every container and image the sandboxes created", async () => {
		const mine = { "trellis.case": randomBytes(4).toString("hex") };
		const f = factory({ labels: mine });
		const a = await f.start();
		await a.exec(sh("echo 1 > /work/one"));
		const b = await a.fork();
		await b.exec(sh("echo 2 > /work/two"));
		const c = await b.fork();
		const d = await f.restore({
			ref: { driver: "docker" } as never,
			read: async () => (await c.snapshot()).data,
		});
		const e = await d.fork();
		expect(await counted(mine)).toMatchObject({ containers: 5 });
		expect((await counted(mine)).images).toBeGreaterThanOrEqual(4);
		// In an order that stops parents before their children.
		for (const sb of [a, b, d, c, e]) await sb.stop();
		await a.stop(); // idempotent
		expect(await counted(mine)).toEqual({ containers: 0, images: 0 });
		expect(f.stats.containersCreated).toBe(5);
		expect(f.stats.containersRemoved).toBe(5);
		await expect(a.exec(sh("true"))).rejects.toThrow(/not started/);
	});

	it("creates at most the configured number of containers at once", async () => {
		const f = factory({ maxConcurrentCreates: 2 });
		const all = await Promise.all(Array.from({ length: 6 }, () => f.start()));
		expect(f.stats).toMatchObject({
			limit: 2,
			maxCreating: 2,
			creating: 0,
			creations: 6,
		});
		expect(new Set(all.map((sb) => sb.containerId)).size).toBe(6);
		await Promise.all(all.map((sb) => sb.stop()));
	});

	it("compiles and runs a C program in the Debian image, with dash keeping the shell state", async (ctx) => {
		// Built by `.ci/docker.sh` (mmdebstrap); locally only on request.
		const image = "trellis-debian:latest";
		const present = await engine.inspectImage(image).then(
			() => true,
			() => false,
		);
		if (!present && !process.env.CI) ctx.skip();
		const a = await factory({ image }).start();
		const source = 'int main(void) { puts("compiled"); return 3; }';
		const build = await a.exec(
			sh(
				`mkdir -p /work/c && cd /work/c && export CFLAGS=-O2 && printf '#include <stdio.h>\\n%s\\n' '${source}' > main.c && gcc $CFLAGS main.c -o main`,
			),
		);
		expect(build).toMatchObject({ output: "", exitCode: 0 });
		const b = await a.fork();
		const ran = await b.exec(sh("pwd; echo $CFLAGS; ./main"));
		expect(ran).toMatchObject({
			output: "/work/c\n-O2\ncompiled\n",
			exitCode: 3,
		});
		await Promise.all([a.stop(), b.stop()]);
	});

	it("takes reading commands as stateless and everything else as state-changing", () => {
		const f = factory();
		expect(f.mutates(sh("cat /work/x | wc -l"))).toBe(false);
		expect(f.mutates(sh("rm /work/x"))).toBe(true);
		expect(f.mutates(sh("ls > out"))).toBe(true);
		expect(f.mutates({ tool: "sql", args: "select 1" })).toBe(true);
	});
});

// A fault the real engine produces only when two deletes of one image race:
// the loser gets a 500 instead of a 404. A stand-in engine on a Unix socket
// answers each delete with one of the engine's own replies.
describe("DockerEngine.removeImage against the engine's refusals", () => {
	it("counts a racing delete's 500 and a 404 as gone, and keeps an image in use (409)", async () => {
		const { createServer } = await import("node:http");
		const { mkdtemp, rm } = await import("node:fs/promises");
		const { tmpdir } = await import("node:os");
		const replies: Record<string, [number, string]> = {
			raced: [500, "unrecognized image ID sha256:1811752997e5"],
			gone: [404, "No such image: gone:latest"],
			used: [409, "conflict: unable to remove repository reference"],
			broken: [500, "driver failed removing layer"],
		};
		const server = createServer((req, res) => {
			const name = decodeURIComponent(req.url!.split("/images/")[1] ?? "");
			const [status, message] = replies[name] ?? [200, ""];
			res.writeHead(status, { "content-type": "application/json" });
			res.end(JSON.stringify(status === 200 ? [] : { message }));
		});
		const dir = await mkdtemp(path.join(tmpdir(), "trellis-fake-engine-"));
		const socket = path.join(dir, "docker.sock");
		await new Promise<void>((r) => server.listen(socket, r));
		try {
			const fake = new DockerEngine(socket);
			expect(await fake.removeImage("raced")).toBe(true);
			expect(await fake.removeImage("gone")).toBe(true);
			expect(await fake.removeImage("used")).toBe(false);
			expect(await fake.removeImage("removed")).toBe(true);
			await expect(fake.removeImage("broken")).rejects.toThrow(
				/driver failed removing layer \(500\)/,
			);
		} finally {
			server.close();
			await rm(dir, { recursive: true, force: true });
		}
	});
});
