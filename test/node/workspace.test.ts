/**
 * The workspace driver on its own: real directories, real `bash`, real
 * tarballs. No cache is involved.
 */
import { existsSync } from "node:fs";
import { readdir } from "node:fs/promises";
import path from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
	WorkspaceSandbox,
	defaultMutates,
	looksReadOnly,
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

describe("which workspace calls change state", () => {
	it("counts plain reads as stateless and anything that may write as state-changing", () => {
		for (const cmd of [
			"cat a.txt",
			"ls -la",
			"grep -r foo . | wc -l",
			"git status",
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
