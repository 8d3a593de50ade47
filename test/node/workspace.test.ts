/**
 * The workspace driver on its own: real directories, real `bash`, real
 * tarballs, real bubblewrap. No cache is involved.
 */
import { randomBytes } from "node:crypto";
import { existsSync, readFileSync, readdirSync } from "node:fs";
import { readFile, readdir } from "node:fs/promises";
import { createServer, type AddressInfo } from "node:net";
import path from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
	WorkspaceSandbox,
	defaultMutates,
	looksReadOnly,
	probeBwrap,
	workspaceFactory,
} from "../../host/drivers/workspace.ts";
import { cleanTmp, tmp } from "./helpers.ts";

let root: string;
const sh = (cmd: string, extra: Record<string, unknown> = {}) => ({
	tool: "bash",
	args: { cmd, ...extra },
});

beforeAll(async () => {
	root = await tmp("ws");
});
afterAll(cleanTmp);

/** Whether a process exists and is not a zombie waiting to be reaped. */
function alive(pid: number): boolean {
	try {
		const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
		return !/^\d+ \(.*\) Z/.test(stat);
	} catch {
		return false;
	}
}

/** Live processes whose environment names the sandbox at `dir`. */
function sandboxProcesses(dir: string): number[] {
	const mark = `TRELLIS_WORKSPACE=${dir}\0`;
	return readdirSync("/proc")
		.map(Number)
		.filter((pid) => {
			if (!Number.isInteger(pid) || !alive(pid)) return false;
			try {
				return readFileSync(`/proc/${pid}/environ`, "latin1").includes(mark);
			} catch {
				return false;
			}
		});
}

/** Whether a process is gone within a second: a kill takes a moment to land. */
async function gone(pid: number): Promise<boolean> {
	for (let i = 0; i < 100 && alive(pid); i++)
		await new Promise((r) => setTimeout(r, 10));
	return !alive(pid);
}

async function started(
	options: Partial<ConstructorParameters<typeof WorkspaceSandbox>[0]> = {},
) {
	const sb = new WorkspaceSandbox({ root, ...options });
	await sb.start();
	return sb;
}

describe("WorkspaceSandbox", () => {
	it("runs a command in its own directory and returns stdout and stderr in order with the exit code", async () => {
		const sb = await started();
		const r = await sb.exec(
			sh("echo one; echo two >&2; echo three; pwd; exit 7"),
		);
		expect(r.output).toBe(`one\ntwo\nthree\n${sb.dir}\n`);
		expect(r.exitCode).toBe(7);
		expect(r.execMs).toBeGreaterThan(0);
		await sb.stop();
	});

	it("takes the command as a plain string too, and runs it in a cwd inside the workspace", async () => {
		const sb = await started();
		await sb.exec({ tool: "bash", args: "mkdir -p sub/dir" });
		const r = await sb.exec(sh("pwd", { cwd: "sub/dir" }));
		expect(r.output).toBe(`${path.join(sb.dir, "sub/dir")}\n`);
		await expect(sb.exec(sh("pwd", { cwd: "../.." }))).rejects.toThrow(
			/outside the workspace/,
		);
		await sb.stop();
	});

	it("refuses a tool it does not run", async () => {
		const sb = await started();
		await expect(sb.exec({ tool: "sql", args: "select 1" })).rejects.toThrow(
			/does not run tool sql/,
		);
		await sb.stop();
	});

	it("kills a command at its timeout, background children included, and reports exit code 124", async () => {
		const sb = await started({ timeoutMs: 300 });
		const t0 = Date.now();
		const r = await sb.exec(sh("sleep 30 & sleep 30; echo never"));
		expect(Date.now() - t0).toBeLessThan(5000);
		expect(r.exitCode).toBe(124);
		expect(r.output).toContain("[timed out after 300 ms]");
		expect(r.output).not.toContain("never");
		await sb.stop();
	});

	it("kills a job that left its session (setsid) when the command exits, as it kills background jobs", async () => {
		// killGroup cannot reach it: it is found by the sandbox's variable.
		const sb = await started({ timeoutMs: 5000 });
		try {
			// The wait makes sure the job has left before the command exits.
			// Killed, its pipe closes: no "[output cut: ...]" after the grace.
			const r = await sb.exec(
				sh(
					"setsid sh -c 'echo $$ > stray.pid; exec sleep 30' & " +
						"until [ -s stray.pid ]; do sleep 0.05; done; echo hi",
				),
			);
			expect(r.output).toBe("hi\n");
			expect(r.exitCode).toBe(0);
			const pid = Number(
				await readFile(path.join(sb.dir, "stray.pid"), "utf8"),
			);
			expect(await gone(pid)).toBe(true);
		} finally {
			await sb.stop();
		}
	}, 15_000);

	it("leaves nothing of a stray that keeps forking", async () => {
		// Killed one by one, such a job could start a child between the scan
		// and the kill; stopped first, it cannot.
		const sb = await started({ timeoutMs: 5000 });
		try {
			await sb.exec(
				sh(
					"setsid sh -c 'while :; do sleep 30 & done' >/dev/null 2>&1 & " +
						"sleep 0.3",
				),
			);
			await new Promise((r) => setTimeout(r, 200));
			expect(sandboxProcesses(sb.dir)).toEqual([]);
		} finally {
			await sb.stop();
		}
	}, 15_000);

	it("kills a daemon that closed its output when the sandbox stops, and leaves other sandboxes' alone", async () => {
		const a = await started();
		const b = await started();
		const daemon =
			"setsid nohup sh -c 'echo $$ > d.pid; exec sleep 30' >/dev/null 2>&1 < /dev/null & " +
			"until [ -s d.pid ]; do sleep 0.05; done";
		// A direct library user may run a long-lived job in a command of its
		// own; the strays of the command are gone when it returns.
		await a.exec(sh(daemon));
		const aPid = Number(await readFile(path.join(a.dir, "d.pid"), "utf8"));
		expect(await gone(aPid)).toBe(true);
		// One started by hand under b's variable, outside any exec, is b's:
		// stopping a leaves it, stopping b kills it.
		const { spawn } = await import("node:child_process");
		const stray = spawn("sleep", ["30"], {
			env: { ...process.env, TRELLIS_WORKSPACE: b.dir },
			detached: true,
			stdio: "ignore",
		});
		try {
			await a.stop();
			expect(alive(stray.pid!)).toBe(true);
			await b.stop();
			expect(await gone(stray.pid!)).toBe(true);
		} finally {
			if (alive(stray.pid!)) process.kill(stray.pid!, "SIGKILL");
		}
	}, 15_000);

	it("returns when the command exits even if a job that cleared its environment holds the output open", async () => {
		// Such a job escapes both kills; waiting for the pipe to close would
		// wait for it, forever for a daemon.
		const sb = await started({ timeoutMs: 500 });
		const t0 = Date.now();
		try {
			const r = await sb.exec(
				sh(
					"setsid env -i sh -c 'echo $$ > stray.pid; exec sleep 30' & " +
						"until [ -s stray.pid ]; do sleep 0.05; done; echo hi",
				),
			);
			expect(Date.now() - t0).toBeLessThan(5000);
			expect(r.output).toContain("hi");
			// Said, so a cached result does not pass for the whole output.
			expect(r.output).toContain(
				"[output cut: a process outside the command's group held it open]",
			);
			expect(r.exitCode).toBe(0);
		} finally {
			const pid = Number(
				await readFile(path.join(sb.dir, "stray.pid"), "utf8").catch(() => ""),
			);
			if (pid > 0) process.kill(pid, "SIGKILL");
			await sb.stop();
		}
	}, 15_000);

	it("answers a cwd that does not exist with a failed command, not an error", async () => {
		// A failing command is a result: the host must not drop the sandbox.
		const sb = await started();
		const r = await sb.exec(sh("echo ran", { cwd: "nope/deeper" }));
		expect(r.exitCode).not.toBe(0);
		expect(r.output).toContain("nope/deeper: No such file or directory");
		expect(r.output).not.toContain("ran");
		expect(r.output).not.toContain(sb.dir);
		// A file is no directory either.
		await sb.exec(sh("touch f"));
		const file = await sb.exec(sh("echo ran", { cwd: "f" }));
		expect(file.exitCode).not.toBe(0);
		expect(file.output).toContain("f: Not a directory");
		await sb.stop();
	});

	it("cuts the output at the size cap and says how much it dropped", async () => {
		const sb = await started({ maxOutputBytes: 64 });
		const r = await sb.exec(sh("head -c 1000 /dev/zero | tr '\\0' a"));
		expect(
			r.output.startsWith(
				"a".repeat(64) + "\n[output truncated: 936 more bytes]",
			),
		).toBe(true);
		expect(r.exitCode).toBe(0);
		await sb.stop();
	});

	it("turns bytes that are not UTF-8 into replacement characters, so the output is valid Unicode", async () => {
		const sb = await started();
		const r = await sb.exec(sh("printf 'ok\\377\\376'"));
		expect(r.output).toBe("ok\uFFFD\uFFFD");
		expect(r.output.isWellFormed()).toBe(true);
		await sb.stop();
	});

	it("forks into an independent copy of the directory", async () => {
		const sb = await started();
		await sb.exec(sh("echo base > f.txt"));
		const twin = await sb.fork();
		expect(twin.dir).not.toBe(sb.dir);
		await twin.exec(sh("echo twin > f.txt"));
		expect((await sb.exec(sh("cat f.txt"))).output).toBe("base\n");
		expect((await twin.exec(sh("cat f.txt"))).output).toBe("twin\n");
		await Promise.all([sb.stop(), twin.stop()]);
	});

	it("restores a snapshot's files, links and modes into another sandbox, dropping files made since", async () => {
		const sb = await started();
		await sb.exec(
			sh(
				"mkdir -p a/b && echo hello > a/b/f && ln -s a/b/f link && echo '#!/bin/sh' > run.sh && chmod 755 run.sh",
			),
		);
		const snap = await sb.snapshot();
		expect(snap.driver).toBe("workspace");
		expect([...snap.data.subarray(0, 2)]).toEqual([0x1f, 0x8b]); // gzip magic

		const other = await started();
		await other.exec(sh("echo stray > stray.txt"));
		await other.restore({
			ref: { driver: "workspace", key: "k", bytes: snap.data.length },
			read: async () => snap.data,
		});
		const r = await other.exec(sh("cat link; stat -c %a run.sh; ls"));
		expect(r.output).toBe("hello\n755\na\nlink\nrun.sh\n");
		await Promise.all([sb.stop(), other.stop()]);
	});

	it("writes a snapshot to a file and restores from it", async () => {
		const sb = await started();
		await sb.exec(sh("echo from-file > x"));
		const file = path.join(root, "snap.tgz");
		const { bytes } = await sb.snapshotTo(file);
		expect(bytes).toBeGreaterThan(0);
		const other = await started();
		await other.restoreFile(file);
		expect((await other.exec(sh("cat x"))).output).toBe("from-file\n");
		await Promise.all([sb.stop(), other.stop()]);
	});

	it("refuses to restore another driver's snapshot", async () => {
		const sb = await started();
		await expect(
			sb.restore({
				ref: { driver: "docker", key: "img", bytes: 0 },
				read: async () => new Uint8Array(),
			}),
		).rejects.toThrow(/cannot restore a docker snapshot/);
		await sb.stop();
	});

	it("removes its directory when stopped", async () => {
		const sb = await started();
		const dir = sb.dir;
		expect(existsSync(dir)).toBe(true);
		await sb.stop();
		expect(existsSync(dir)).toBe(false);
		await sb.stop(); // idempotent
	});
});

// Where bubblewrap cannot run (user namespaces forbidden) the isolated tests
// skip on a workstation; CI installs it, so a skip there would hide a break.
const bwrap = await probeBwrap();
const describeIsolated =
	bwrap.usable || process.env.CI ? describe : describe.skip;

describeIsolated("WorkspaceSandbox isolated with bubblewrap", () => {
	const isolated = (options: Parameters<typeof started>[0] = {}) =>
		started({ isolate: "bwrap", ...options });

	it("runs every sandbox's commands at the same fixed path, so outputs naming it agree", async () => {
		const [a, b] = await Promise.all([isolated(), isolated()]);
		expect(a.isolation).toBe("bwrap");
		expect(a.dir).not.toBe(b.dir);
		const cmd = sh("pwd; echo $HOME $TRELLIS_WORKSPACE; echo err >&2; exit 7");
		const [ra, rb] = await Promise.all([a.exec(cmd), b.exec(cmd)]);
		expect(ra.output).toBe("/work\n/work /work\nerr\n");
		expect(rb.output).toBe(ra.output);
		expect(ra.exitCode).toBe(7);
		await a.exec(sh("mkdir -p sub/dir"));
		expect((await a.exec(sh("pwd", { cwd: "sub/dir" }))).output).toBe(
			"/work/sub/dir\n",
		);
		const missing = await a.exec(sh("pwd", { cwd: "sub/nope" }));
		expect(missing.exitCode).toBe(1);
		expect(missing.output).toContain("sub/nope: No such file or directory");
		await Promise.all([a.stop(), b.stop()]);
	});

	it("writes its own directory, where the host sees the files", async () => {
		const sb = await isolated();
		const r = await sb.exec(sh("echo hi > f && mkdir d && touch d/g"));
		expect(r.exitCode).toBe(0);
		expect(await readFile(path.join(sb.dir, "f"), "utf8")).toBe("hi\n");
		expect(existsSync(path.join(sb.dir, "d/g"))).toBe(true);
		await sb.stop();
	});

	it("cannot write the host's files, another directory or a sibling sandbox", async () => {
		const sb = await isolated();
		const sibling = await isolated();
		const outside = await tmp("ws-outside");
		const name = `trellis-${randomBytes(6).toString("hex")}`;
		const r = await sb.exec(
			sh(
				[
					`touch /etc/${name}`,
					`touch ${outside}/x`,
					`touch ${sibling.dir}/x`,
					`touch ${root}/x`,
				]
					.map((c) => `${c} 2>/dev/null; echo $?`)
					.join("; "),
			),
		);
		expect(r.output).not.toMatch(/^0$/m);
		expect(r.output.split("\n").filter(Boolean)).toHaveLength(4);
		expect(existsSync(`/etc/${name}`)).toBe(false);
		expect(existsSync(path.join(outside, "x"))).toBe(false);
		expect(existsSync(path.join(sibling.dir, "x"))).toBe(false);
		expect(existsSync(path.join(root, "x"))).toBe(false);
		await Promise.all([sb.stop(), sibling.stop()]);
	});

	it("gives each command a private /tmp that neither the host nor the next command sees", async () => {
		// /tmp is not in a snapshot, so state left there would not survive a
		// restore: better that no command can rely on it.
		const sb = await isolated();
		const name = `trellis-${randomBytes(6).toString("hex")}`;
		const r = await sb.exec(sh(`echo x > /tmp/${name} && cat /tmp/${name}`));
		expect(r.output).toBe("x\n");
		expect(existsSync(`/tmp/${name}`)).toBe(false);
		const again = await sb.exec(sh(`test -e /tmp/${name}; echo $?`));
		expect(again.output).toBe("1\n");
		await sb.stop();
	});

	it("reaches no network, not even the host's loopback, unless asked", async () => {
		const server = createServer((socket) => socket.end());
		await new Promise<void>((resolve) =>
			server.listen(0, "127.0.0.1", resolve),
		);
		const { port } = server.address() as AddressInfo;
		const probe = sh(
			`(exec 3<>/dev/tcp/127.0.0.1/${port}) 2>/dev/null && echo connected || echo unreachable`,
		);
		const off = await isolated();
		const on = await isolated({ network: true });
		expect((await off.exec(probe)).output).toBe("unreachable\n");
		expect((await on.exec(probe)).output).toBe("connected\n");
		await Promise.all([off.stop(), on.stop()]);
		await new Promise((resolve) => server.close(resolve));
	});

	it("writes a path outside only when the caller binds it, as a log in the env needs", async () => {
		const outside = await tmp("ws-log");
		const log = path.join(outside, "ran.log");
		const cmd = sh('echo ran >> "$LOG"');
		const bound = await isolated({ env: { LOG: log }, binds: [outside] });
		expect((await bound.exec(cmd)).exitCode).toBe(0);
		expect(await readFile(log, "utf8")).toBe("ran\n");
		const unbound = await isolated({ env: { LOG: log } });
		expect((await unbound.exec(cmd)).exitCode).not.toBe(0);
		expect(await readFile(log, "utf8")).toBe("ran\n");
		await Promise.all([bound.stop(), unbound.stop()]);
	});

	it("refuses binds that are relative or inside the fixed path, and reports a bind bubblewrap cannot make", async () => {
		const relative = await isolated({ binds: ["logs"] });
		await expect(relative.exec(sh("true"))).rejects.toThrow(/not an absolute/);
		const inside = await isolated({ binds: ["/work/x"] });
		await expect(inside.exec(sh("true"))).rejects.toThrow(/inside \/work/);
		const missing = await isolated({ binds: [path.join(root, "nope")] });
		await expect(missing.exec(sh("echo ran"))).rejects.toThrow(
			/bubblewrap failed/,
		);
		await Promise.all([relative.stop(), inside.stop(), missing.stop()]);
	});

	it("kills a timed-out command and its background children, and does not wait for jobs left behind", async () => {
		const sb = await isolated({ timeoutMs: 300 });
		const t0 = Date.now();
		const r = await sb.exec(sh("sleep 30 & sleep 30; echo never"));
		expect(r.exitCode).toBe(124);
		expect(r.output).not.toContain("never");
		const left = await sb.exec(
			sh("sleep 30 & echo done", { timeoutMs: 20_000 }),
		);
		expect(left).toMatchObject({ output: "done\n", exitCode: 0 });
		expect(Date.now() - t0).toBeLessThan(5000);
		await sb.stop();
	});

	it("forks, snapshots and restores isolated sandboxes", async () => {
		const sb = await isolated();
		await sb.exec(sh("echo base > f.txt && ln -s f.txt link"));
		const twin = await sb.fork();
		expect(twin.isolation).toBe("bwrap");
		await twin.exec(sh("echo twin > f.txt"));
		expect((await sb.exec(sh("cat link"))).output).toBe("base\n");
		expect((await twin.exec(sh("cat link; pwd"))).output).toBe("twin\n/work\n");
		const snap = await twin.snapshot();
		const other = await isolated();
		await other.restore({
			ref: { driver: "workspace", key: "k", bytes: snap.data.length },
			read: async () => snap.data,
		});
		expect((await other.exec(sh("cat link; ls"))).output).toBe(
			"twin\nf.txt\nlink\n",
		);
		await Promise.all([sb.stop(), twin.stop(), other.stop()]);
	});
});

describe("choosing the workspace's isolation", () => {
	it("runs without isolation by default, in the sandbox's real directory", async () => {
		const sb = await started();
		expect(sb.isolation).toBe("none");
		expect((await sb.exec(sh("pwd"))).output).toBe(`${sb.dir}\n`);
		await sb.stop();
	});

	it("falls back to none under auto, saying so once, where bubblewrap cannot run; refuses to start when bwrap is required", async () => {
		const lines: string[] = [];
		const options = {
			isolate: "auto" as const,
			bwrap: path.join(root, "no-such-bwrap"),
			log: (line: string) => lines.push(line),
		};
		const a = await started(options);
		const b = await started(options);
		expect([a.isolation, b.isolation]).toEqual(["none", "none"]);
		expect(lines).toHaveLength(1);
		expect(lines[0]).toMatch(/without isolation/);
		await expect(started({ ...options, isolate: "bwrap" })).rejects.toThrow(
			/cannot run here/,
		);
		await Promise.all([a.stop(), b.stop()]);
	});

	it.runIf(bwrap.usable)(
		"isolates under auto where bubblewrap runs",
		async () => {
			const sb = await started({ isolate: "auto" });
			expect(sb.isolation).toBe("bwrap");
			expect((await sb.exec(sh("pwd"))).output).toBe("/work\n");
			await sb.stop();
		},
	);
});

describe("which workspace calls change state", () => {
	it("counts plain reads as stateless and anything that may write as state-changing", () => {
		for (const cmd of [
			"cat a.txt",
			"ls -la",
			"grep -r foo . | wc -l",
			"git rev-parse HEAD",
			"sha256sum f",
		])
			expect(looksReadOnly(cmd), cmd).toBe(true);
		for (const cmd of [
			"echo x > f",
			"cat a; rm a",
			"sed -i s/a/b/ f",
			"find . -delete",
			"sort -o f f",
			"cat $(rm x)",
			"git commit -m x",
			"python run.py",
		])
			expect(looksReadOnly(cmd), cmd).toBe(false);
	});

	it("counts reading commands given an output file, or told to run a program, as state-changing", () => {
		// Each of these writes a file (or runs one) though its command reads.
		for (const cmd of [
			"uniq in out",
			"uniq -c in out",
			"uniq - out",
			"uniq -- -in out",
			"xxd in out",
			"xxd -r dump bin",
			"tree -o f",
			"tree -ao f",
			"tree -R -H . -L 1",
			"sort -uo f x",
			"sort -ofile x",
			"sort --output=f x",
			"sort --outp=f x",
			"sort --compress-program=./run x",
			'sort "-o" f x',
			"sort \\-o f x",
			"git diff --output=f",
			"git log -p --output f",
			"git show HEAD --output=f",
			"find . '-delete'",
			"rg --pre ./run foo",
			"file -C -m magic",
			"cat f | uniq - out",
		])
			expect(looksReadOnly(cmd), cmd).toBe(false);
		// The same commands reading stay stateless.
		for (const cmd of [
			"uniq f",
			"sort f | uniq -c",
			"xxd f",
			"tree -L 2",
			"sort -u f",
			"sort -k 2 -t , f",
			"find . -name '*.py'",
			"rg foo src",
			"file f",
		])
			expect(looksReadOnly(cmd), cmd).toBe(true);
	});

	it("counts git's reads that a repository's config can make run a program as state-changing", async () => {
		// The reason, for real: the sandbox's own .git/config makes `git
		// status` write a file.
		const sb = await started();
		try {
			await sb.exec(
				sh(
					"git init -q && git -c user.email=a@b -c user.name=a commit -q --allow-empty -m x && " +
						"git config core.fsmonitor 'touch written; false #'",
				),
			);
			await sb.exec(sh("git status"));
			expect(existsSync(path.join(sb.dir, "written"))).toBe(true);
		} finally {
			await sb.stop();
		}
		for (const cmd of [
			"git status",
			"git ls-files",
			"git diff HEAD~1",
			"git show HEAD",
			"git log --oneline",
			"git blame f",
		])
			expect(looksReadOnly(cmd), cmd).toBe(false);
		expect(looksReadOnly("git rev-parse --show-toplevel")).toBe(true);
	});

	it("treats tools other than the shell, and args it cannot read, as state-changing", () => {
		expect(defaultMutates({ tool: "sql", args: "select 1" })).toBe(true);
		expect(defaultMutates({ tool: "bash", args: 42 })).toBe(true);
		expect(defaultMutates({ tool: "bash", args: { cmd: "cat f" } })).toBe(
			false,
		);
	});

	it("lets the options decide instead", async () => {
		const fresh = await tmp("ws-factory");
		const factory = workspaceFactory({
			root: fresh,
			mutates: (c) => c.tool !== "bash",
		});
		expect(factory.mutates({ tool: "bash", args: "rm -rf x" })).toBe(false);
		expect(factory.driver).toBe("workspace");
		// The factory's probe instance must not have made a directory.
		expect(await readdir(fresh)).toEqual([]);
	});
});
