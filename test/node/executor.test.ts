/**
 * CachedToolExecutor end to end: a real local stack, real workspace
 * sandboxes, real shell commands. Every command appends its name to a log
 * file outside the sandboxes (`$LOG`), so the tests count what really ran
 * instead of trusting the executor's own counters.
 */
import { createHash } from "node:crypto";
import { readdir } from "node:fs/promises";
import path from "node:path";
import {
	afterAll,
	afterEach,
	beforeAll,
	describe,
	expect,
	it,
	vi,
} from "vitest";
import { startLocalStack, type LocalStack } from "../../bin/local-stack.ts";
import {
	CachedToolExecutor,
	TrellisClient,
	TrellisError,
	type ExecutorOptions,
	type Lease,
	type RecordInput,
	type RecordResponse,
	type Sandbox,
	type SandboxFactory,
	type SnapshotRef,
} from "../../client/index.ts";
import { workspaceFactory } from "../../host/drivers/workspace.ts";
import { cleanTmp, countLines, logLines, taskName, tmp } from "./helpers.ts";

let stack: LocalStack;
let client: TrellisClient;
const open: CachedToolExecutor[] = [];

beforeAll(async () => {
	stack = await startLocalStack({ persistTo: await tmp("executor-state") });
	client = new TrellisClient({ url: stack.url, key: stack.trainerKey });
});
afterEach(async () => {
	await Promise.all(open.splice(0).map((e) => e.close()));
});
afterAll(async () => {
	await stack?.stop();
	await cleanTmp();
});

/** One test's world: a task, a sandbox root and a log outside the sandboxes. */
async function world(label: string) {
	const dir = await tmp(label);
	const root = path.join(dir, "sandboxes");
	const log = path.join(dir, "ran.log");
	const task = taskName(label);
	const sandboxes = workspaceFactory({ root, env: { LOG: log } });
	const rollout = (options: Partial<ExecutorOptions> = {}) => {
		const e = new CachedToolExecutor({ client, task, sandboxes, ...options });
		open.push(e);
		return e;
	};
	return { task, root, log, sandboxes, rollout };
}

/** A promise with its resolver, for gates and signals between a test and a double. */
function deferred<T = void>() {
	let resolve!: (value: T) => void;
	const promise = new Promise<T>((r) => (resolve = r));
	return { promise, resolve };
}

type Faulty = "record" | "putSnapshot" | "releaseLease";

/**
 * The real client, except that a method armed with {@link fail} throws
 * once, without sending anything, as if every retry had failed; and it
 * tells about each lease renewal it sends.
 */
class TestFaultyClient extends TrellisClient {
	readonly #armed = new Map<Faulty, TrellisError>();
	/** Each renewal's `ttlMs` and the lease the server answered with. */
	readonly renewals: { ttlMs: number | undefined; lease: Promise<Lease> }[] =
		[];
	onRenew: () => void = () => {};

	/** Makes the next `method` call fail, by default with a 503 whose code is `injected_<method>`. */
	fail(method: Faulty, status = 503, code = `injected_${method}`): void {
		this.#armed.set(
			method,
			new TrellisError({
				status,
				code,
				message: `${method} failed (injected)`,
			}),
		);
	}

	#trip(method: Faulty): void {
		const err = this.#armed.get(method);
		this.#armed.delete(method);
		if (err) throw err;
	}

	override async record(
		task: string,
		request: RecordInput,
	): Promise<RecordResponse> {
		this.#trip("record");
		return super.record(task, request);
	}

	override async putSnapshot(
		task: string,
		state: string,
		data: Uint8Array,
		driver: string,
	): Promise<SnapshotRef> {
		this.#trip("putSnapshot");
		return super.putSnapshot(task, state, data, driver);
	}

	override async releaseLease(
		task: string,
		id: string,
	): Promise<{ id: string; released: true }> {
		this.#trip("releaseLease");
		return super.releaseLease(task, id);
	}

	override renewLease(task: string, id: string, ttlMs?: number) {
		const lease = super.renewLease(task, id, ttlMs);
		this.renewals.push({ ttlMs, lease });
		this.onRenew();
		return lease;
	}
}

function faultyClient(): TestFaultyClient {
	return new TestFaultyClient({ url: stack.url, key: stack.trainerKey });
}

/** A shell command that logs its name outside the sandbox, then runs `cmd`. */
const logged = (name: string, cmd: string) => ({
	cmd: `echo ${name} >> "$LOG"; ${cmd}`,
});
const W = { mutates: true };
const RO = { mutates: false };

describe("CachedToolExecutor", () => {
	it("keeps `cat` before and after a patch apart: same call, different state, different output", async () => {
		const { rollout } = await world("patch");
		const a = rollout();
		await a.call("bash", logged("write", "printf 'print(1)\\n' > foo.py"), W);
		const before = await a.call("bash", logged("cat", "cat foo.py"), RO);
		await a.call("bash", logged("patch", "sed -i s/1/2/ foo.py"), W);
		const after = await a.call("bash", logged("cat", "cat foo.py"), RO);
		const sum = await a.call("bash", logged("sum", "sha256sum foo.py"), RO);
		expect(before.output).toBe("print(1)\n");
		expect(after.output).toBe("print(2)\n");
		expect(after.id).not.toBe(before.id);
		const digest = createHash("sha256").update("print(2)\n").digest("hex");
		expect(sum.output).toBe(`${digest}  foo.py\n`);

		// A second rollout gets each output back from the cache, in its state.
		const b = rollout();
		await b.call("bash", logged("write", "printf 'print(1)\\n' > foo.py"), W);
		expect((await b.call("bash", logged("cat", "cat foo.py"), RO)).output).toBe(
			"print(1)\n",
		);
		await b.call("bash", logged("patch", "sed -i s/1/2/ foo.py"), W);
		const cached = await b.call("bash", logged("cat", "cat foo.py"), RO);
		expect([cached.status, cached.output]).toEqual(["hit", "print(2)\n"]);
	});

	it("a second rollout of the same task gets only hits and executes nothing", async () => {
		const { log, rollout } = await world("second");
		const script: [string, string, { mutates: boolean }][] = [
			["clone", "mkdir repo && echo 'int main(){}' > repo/main.c", W],
			["ls", "ls repo", RO],
			["build", "cp repo/main.c repo/main.o", W],
			["test", "ls repo | wc -l", RO],
		];
		const a = rollout();
		let recordedMs = 0;
		for (const [name, cmd, o] of script)
			recordedMs += (await a.call("bash", logged(name, cmd), o)).execMs;
		expect(a.counters).toMatchObject({
			hits: 0,
			misses: 4,
			executed: 4,
			replayed: 0,
		});
		const ranBefore = await logLines(log);
		expect(ranBefore).toEqual(["clone", "ls", "build", "test"]);

		const b = rollout();
		const outputs: string[] = [];
		for (const [name, cmd, o] of script) {
			const r = await b.call("bash", logged(name, cmd), o);
			expect(r.status).toBe("hit");
			outputs.push(r.output);
		}
		expect(outputs).toEqual(["", "main.c\n", "", "2\n"]);
		expect(b.counters).toMatchObject({
			hits: 4,
			misses: 0,
			executed: 0,
			replayed: 0,
		});
		expect(b.counters.savedMs).toBeCloseTo(recordedMs, 6);
		expect(await logLines(log)).toEqual(ranBefore);
	});

	it("replays a state-changing call between reads exactly once, and never the reads (history M1 R1 M2 R2)", async () => {
		const { log, rollout } = await world("tvcache");
		const path4: [string, string, { mutates: boolean }][] = [
			["M1", "echo one >> state", W],
			["R1", "cat state", RO],
			["M2", "echo two >> state", W],
			["R2", "cat state", RO],
		];
		const a = rollout();
		for (const [name, cmd, o] of path4)
			await a.call("bash", logged(name, cmd), o);
		// Rollout a kept its sandbox between misses: nothing was replayed.
		expect(a.counters).toMatchObject({ misses: 4, executed: 4, replayed: 0 });

		const b = rollout();
		for (const [name, cmd, o] of path4)
			expect((await b.call("bash", logged(name, cmd), o)).status).toBe("hit");
		// A new call after the matched path: a fresh sandbox replays M1 and M2.
		const x = await b.call(
			"bash",
			logged("X", "echo three >> state; cat state"),
			W,
		);
		expect([x.status, x.output]).toEqual(["miss", "one\ntwo\nthree\n"]);
		expect(b.counters).toMatchObject({
			hits: 4,
			misses: 1,
			replayed: 2,
			executed: 3,
		});
		expect(await countLines(log, "M2")).toBe(2); // a's run + exactly one replay
		expect(await countLines(log, "M1")).toBe(2);
		expect(await countLines(log, "R1")).toBe(1); // reads are never replayed
		expect(await countLines(log, "R2")).toBe(1);
	});

	it("restores a partial match from the uploaded snapshot and replays only the suffix", async () => {
		const { task, log, rollout } = await world("partial");
		const step = (i: number) => logged(`M${i}`, `echo ${i} >> state`);
		const a = rollout({ snapshotWhen: ({ depth }) => depth === 2 });
		for (const i of [1, 2, 3]) await a.call("bash", step(i), W);
		expect(a.counters.snapshots).toBe(1);
		expect((await client.stats(task)).snapshots).toBe(1);

		const b = rollout();
		for (const i of [1, 2, 3])
			expect((await b.call("bash", step(i), W)).status).toBe("hit");
		const r = await b.call(
			"bash",
			logged("M4", "echo 4 >> state; cat state"),
			W,
		);
		// The restored files plus the replayed M3 make the state M4 runs in.
		expect(r.output).toBe("1\n2\n3\n4\n");
		expect(b.counters).toMatchObject({ restores: 1, replayed: 1, executed: 2 });
		expect(await logLines(log)).toEqual(["M1", "M2", "M3", "M3", "M4"]);
	});

	it("releases the snapshot's lease once the miss is recorded", async () => {
		const { task, rollout } = await world("lease");
		const a = rollout({ snapshotEvery: 1 });
		await a.call("bash", { cmd: "echo a > f" }, W);
		const b = rollout();
		await b.call("bash", { cmd: "echo a > f" }, W);
		await b.call("bash", { cmd: "cat f; echo b >> f" }, W);
		expect(b.counters).toMatchObject({ restores: 1, leases: 1 });
		expect((await client.stats(task)).leases).toBe(0);
	});

	it("answers reads reordered between the same writes from the cache", async () => {
		const { log, rollout } = await world("reorder");
		const a = rollout();
		await a.call("bash", logged("M1", "echo x > f"), W);
		await a.call("bash", logged("Ra", "cat f"), RO);
		await a.call("bash", logged("Rb", "wc -c f"), RO);
		await a.call("bash", logged("M2", "echo y >> f"), W);

		const b = rollout();
		await b.call("bash", logged("M1", "echo x > f"), W);
		const rb = await b.call("bash", logged("Rb", "wc -c f"), RO);
		const ra = await b.call("bash", logged("Ra", "cat f"), RO);
		await b.call("bash", logged("M2", "echo y >> f"), W);
		expect([ra.status, ra.output, rb.status, rb.output]).toEqual([
			"hit",
			"x\n",
			"hit",
			"2 f\n",
		]);
		expect(b.counters.executed).toBe(0);

		// Exactness: the same read after M2 is another state, so it misses.
		const late = await b.call("bash", logged("Ra", "cat f"), RO);
		expect([late.status, late.output]).toEqual(["miss", "x\ny\n"]);
		expect(await countLines(log, "Ra")).toBe(2);
	});

	it("lets the sandbox factory decide what a call changes when the caller does not say", async () => {
		const { rollout } = await world("infer");
		const a = rollout();
		const write = await a.call("bash", { cmd: "echo hi > f" });
		const read = await a.call("bash", { cmd: "cat f" });
		expect(write.state).toBe(write.id); // a state-changing call moves the state
		expect(read.state).toBe(write.state); // a read does not
		expect(a.history.map((c) => c.mutates)).toEqual([true, false]);
	});

	it("reports a replay whose output differs from the recorded one as a conflict, keeping the first", async () => {
		const { task, rollout } = await world("conflict");
		const noisy = { cmd: "head -c 8 /dev/urandom | od -An -tx1 > r; cat r" };
		const a = rollout();
		const first = await a.call("bash", noisy, W);
		const b = rollout();
		expect((await b.call("bash", noisy, W)).output).toBe(first.output);
		await b.call("bash", { cmd: "cat r" }, RO); // forces a replay of the noisy write
		expect(b.counters).toMatchObject({ replayed: 1, conflicts: 1 });
		expect((await client.stats(task)).tools.bash.nondeterministic).toBe(true);
	});

	it("forks a rollout into an independent one that continues from the same state", async () => {
		const { rollout } = await world("fork");
		const a = rollout();
		await a.call("bash", { cmd: "echo base > f" }, W);
		const b = await a.fork();
		open.push(b);
		await b.call("bash", { cmd: "echo fork >> f" }, W);
		await a.call("bash", { cmd: "echo main >> f" }, W);
		expect((await a.call("bash", { cmd: "cat f" }, RO)).output).toBe(
			"base\nmain\n",
		);
		expect((await b.call("bash", { cmd: "cat f" }, RO)).output).toBe(
			"base\nfork\n",
		);
		expect(b.counters.replayed).toBe(0); // the fork's sandbox was already there
	});

	it("stops its sandbox on close and refuses calls afterwards", async () => {
		const { root, rollout } = await world("close");
		const a = rollout();
		await a.call("bash", { cmd: "echo x > f" }, W);
		expect(await readdir(root)).toHaveLength(1);
		await a.close();
		expect(await readdir(root)).toHaveLength(0);
		expect(() => a.call("bash", { cmd: "ls" })).toThrow(/closed/);
	});
});

describe("CachedToolExecutor when something fails", () => {
	it.each(["record", "putSnapshot"] as const)(
		"a state-changing call whose %s fails changes nothing: retried, it runs once on the right state",
		async (method) => {
			const { rollout } = await world(`fail-${method}`);
			const faulty = faultyClient();
			const a = rollout({ client: faulty, snapshotEvery: 1 });
			faulty.fail(method);
			await expect(
				a.call("bash", { cmd: "echo x >> f" }, W),
			).rejects.toMatchObject({ code: `injected_${method}` });
			// The call failed, so the rollout is still where it was.
			expect([a.depth, a.history.length]).toEqual([0, 0]);

			const retried = await a.call("bash", { cmd: "echo x >> f" }, W);
			expect(retried.status).toBe("miss");
			expect((await a.call("bash", { cmd: "cat f" }, RO)).output).toBe("x\n");
			await a.call("bash", { cmd: "echo y >> f" }, W);
			expect((await a.call("bash", { cmd: "cat f" }, RO)).output).toBe(
				"x\ny\n",
			);
			expect(a.depth).toBe(2);
		},
	);

	it.each([
		[403, "quota_exceeded"],
		[413, "too_large"],
	])(
		"a snapshot upload refused with %i %s leaves the call recorded without a snapshot",
		async (status, code) => {
			const { rollout } = await world(`refused-${status}`);
			const faulty = faultyClient();
			const a = rollout({ client: faulty, snapshotEvery: 1 });
			faulty.fail("putSnapshot", status, code);
			const first = await a.call("bash", { cmd: "echo x >> f" }, W);
			expect(first.status).toBe("miss");
			expect(a.counters).toMatchObject({ snapshots: 0, snapshotsRefused: 1 });
			await a.call("bash", { cmd: "echo y >> f" }, W);
			expect(a.counters).toMatchObject({ snapshots: 1, snapshotsRefused: 1 });
			expect((await a.call("bash", { cmd: "cat f" }, RO)).output).toBe(
				"x\ny\n",
			);
			// Recorded: a second rollout gets both calls as hits.
			const b = rollout({ client: faulty });
			expect((await b.call("bash", { cmd: "echo x >> f" }, W)).status).toBe(
				"hit",
			);
			expect((await b.call("bash", { cmd: "echo y >> f" }, W)).status).toBe(
				"hit",
			);
		},
	);

	it("queues fork() with the calls: a call made after it does not leak into the twin", async () => {
		const { sandboxes, rollout } = await world("fork-queue");
		const gate = deferred();
		let forking = false;
		const gated = (s: Sandbox): Sandbox => ({
			driver: s.driver,
			start: () => s.start(),
			async exec(call) {
				const out = await s.exec(call);
				// A call that ran while the fork waits lets the fork go on: it
				// then copies that call's effect.
				if (forking) gate.resolve();
				return out;
			},
			async fork() {
				forking = true;
				// With fork() queued, no call can run before it, so only this
				// timer opens the gate; it is long enough for a call that is not
				// queued behind the fork to run first.
				const timer = setTimeout(() => gate.resolve(), 1000);
				await gate.promise;
				clearTimeout(timer);
				return s.fork();
			},
			snapshot: () => s.snapshot(),
			restore: (source) => s.restore(source),
			stop: () => s.stop(),
			mutates: (call) => s.mutates(call),
		});
		const factory: SandboxFactory = {
			driver: sandboxes.driver,
			start: async () => gated(await sandboxes.start()),
			restore: async (source) => gated(await sandboxes.restore(source)),
			mutates: (call) => sandboxes.mutates(call),
		};
		const a = rollout({ sandboxes: factory });
		await a.call("bash", { cmd: "echo base > f" }, W);
		const [b] = await Promise.all([
			a.fork(),
			a.call("bash", { cmd: "echo main >> f" }, W),
		]);
		open.push(b);
		expect([a.depth, b.depth]).toEqual([2, 1]);
		expect((await b.call("bash", { cmd: "cat f" }, RO)).output).toBe("base\n");
		expect((await a.call("bash", { cmd: "cat f" }, RO)).output).toBe(
			"base\nmain\n",
		);
	});

	it("renews a lease it holds for its own leaseTtlMs, not the server's default", async () => {
		const { sandboxes, rollout } = await world("renew");
		await rollout({ snapshotEvery: 1 }).call("bash", { cmd: "echo a > f" }, W);

		// A restore that waits until the test lets it go, holding the lease.
		const restoring = deferred();
		const gate = deferred();
		const factory: SandboxFactory = {
			...sandboxes,
			driver: sandboxes.driver,
			async restore(source) {
				restoring.resolve();
				await gate.promise;
				return sandboxes.restore(source);
			},
		};
		const faulty = faultyClient();
		const renewed = deferred();
		faulty.onRenew = () => renewed.resolve();
		const b = rollout({
			client: faulty,
			sandboxes: factory,
			leaseTtlMs: 600_000,
		});
		expect((await b.call("bash", { cmd: "echo a > f" }, W)).status).toBe("hit");
		// Only the renewal timer is fake: the HTTP calls run for real.
		vi.useFakeTimers({ toFake: ["setInterval", "clearInterval"] });
		const pending = b.call("bash", { cmd: "cat f; echo b >> f" }, W);
		try {
			await restoring.promise;
			vi.advanceTimersByTime(300_000); // half the lease's life: one renewal
			await renewed.promise;
			const [renewal] = faulty.renewals;
			expect(renewal.ttlMs).toBe(600_000);
			// The server extended the lease by 600 s, not by its default 60 s.
			const lease = await renewal.lease;
			expect(lease.expiresAt - Date.now()).toBeGreaterThan(500_000);
		} finally {
			gate.resolve();
			await pending.catch(() => {});
			vi.useRealTimers();
		}
		expect((await pending).output).toBe("a\n");
		expect(b.counters).toMatchObject({ restores: 1, leases: 1 });
	});

	it("a lease release that fails neither fails a call that succeeded nor hides a call's own error", async () => {
		const { rollout } = await world("release");
		await rollout({ snapshotEvery: 1 }).call("bash", { cmd: "echo a > f" }, W);

		const faulty = faultyClient();
		const b = rollout({ client: faulty });
		await b.call("bash", { cmd: "echo a > f" }, W);
		faulty.fail("releaseLease");
		const ok = await b.call("bash", { cmd: "cat f; echo b >> f" }, W);
		expect([ok.status, ok.output]).toEqual(["miss", "a\n"]);
		expect(b.counters).toMatchObject({ leases: 1, unreleasedLeases: 1 });

		const c = rollout({ client: faulty });
		await c.call("bash", { cmd: "echo a > f" }, W);
		faulty.fail("record");
		faulty.fail("releaseLease");
		await expect(
			c.call("bash", { cmd: "cat f; echo c >> f" }, W),
		).rejects.toMatchObject({ code: "injected_record" });
		expect(c.counters).toMatchObject({ leases: 1, unreleasedLeases: 1 });
	});
});
