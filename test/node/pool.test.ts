/**
 * Warm pools over real workspace sandboxes: real directories are made,
 * forked and removed. Nothing here measures speed; it counts sandboxes.
 */
import { readdir } from "node:fs/promises";
import { afterAll, describe, expect, it } from "vitest";
import type {
	Call,
	Sandbox,
	SandboxFactory,
	SnapshotSource,
} from "../../client/sandbox.ts";
import { workspaceFactory } from "../../host/drivers/workspace.ts";
import { WarmPool, type PoolSpec } from "../../host/pool.ts";
import { cleanTmp, tmp } from "./helpers.ts";

afterAll(cleanTmp);

const sh = (cmd: string): Call => ({ tool: "bash", args: cmd });
const dirs = async (root: string) => (await readdir(root)).length;

async function run(sandbox: Sandbox, cmd: string): Promise<string> {
	const r = await sandbox.exec(sh(cmd));
	expect(r.exitCode, r.output).toBe(0);
	return r.output;
}

/**
 * Wraps a factory to count the sandboxes the pool holds: one is counted
 * from the moment its start or fork is asked for until its stop finished
 * or a test took it over, and the highest count is kept.
 */
function counting(inner: SandboxFactory) {
	const count = { live: 0, max: 0, starts: 0, forks: 0 };
	const up = () => {
		count.live++;
		count.max = Math.max(count.max, count.live);
	};
	const released = new WeakSet<Sandbox>();
	class Counted implements Sandbox {
		readonly driver: string;
		constructor(readonly inner: Sandbox) {
			this.driver = inner.driver;
		}
		start() {
			return this.inner.start();
		}
		exec(call: Call) {
			return this.inner.exec(call);
		}
		async fork(): Promise<Sandbox> {
			count.forks++;
			up();
			try {
				return new Counted(await this.inner.fork());
			} catch (err) {
				count.live--;
				throw err;
			}
		}
		snapshot() {
			return this.inner.snapshot();
		}
		restore(source: SnapshotSource) {
			return this.inner.restore(source);
		}
		async stop() {
			await this.inner.stop();
			if (!released.has(this)) count.live--;
			released.add(this);
		}
		mutates(call: Call) {
			return this.inner.mutates(call);
		}
	}
	const factory: SandboxFactory = {
		driver: inner.driver,
		async start() {
			count.starts++;
			up();
			try {
				return new Counted(await inner.start());
			} catch (err) {
				count.live--;
				throw err;
			}
		},
		async restore(source) {
			up();
			return new Counted(await inner.restore(source));
		},
		mutates: (call) => inner.mutates(call),
	};
	/** Stops counting a sandbox a test took from the pool. */
	const takeOver = (sandbox: Sandbox | null) => {
		expect(sandbox).not.toBeNull();
		if (!released.has(sandbox!)) count.live--;
		released.add(sandbox!);
		return sandbox!;
	};
	return { factory, count, takeOver };
}

describe("WarmPool", () => {
	it("fills a root key to its target in the background and refills after each take", async () => {
		const root = await tmp("pool-root");
		const pool = new WarmPool({ maxTotal: 10 });
		pool.warm("ws:", { kind: "root", factory: workspaceFactory({ root }) }, 3);
		await pool.settled();
		expect(pool.stats().pools).toEqual([{ key: "ws:", ready: 3, target: 3 }]);
		expect(await dirs(root)).toBe(3);

		const taken = pool.take("ws:");
		expect(taken).not.toBeNull();
		// Handed over started, and a real workspace.
		expect(await run(taken!, "echo hi > f && cat f")).toBe("hi\n");
		await pool.settled();
		expect(pool.stats()).toMatchObject({
			pools: [{ key: "ws:", ready: 3, target: 3 }],
			hits: 1,
			misses: 0,
			held: 3,
		});
		expect(pool.stats().starts.pool?.count).toBe(1);
		expect(await dirs(root)).toBe(4);

		await pool.drain();
		await taken!.stop();
		expect(await dirs(root)).toBe(0);
	});

	it("counts a take from an empty or unknown key as a miss, and acquire starts one itself with the source it is told", async () => {
		const root = await tmp("pool-miss");
		const factory = workspaceFactory({ root });
		const pool = new WarmPool({ maxTotal: 4 });
		expect(pool.take("nobody")).toBeNull();

		const fresh = await pool.acquire("nobody", {
			source: "fresh",
			start: () => factory.start(),
		});
		expect(fresh.source).toBe("fresh");
		expect(fresh.startMs).toBeGreaterThan(0);
		await run(fresh.sandbox, "echo state > f");

		const snap = await fresh.sandbox.snapshot();
		const source: SnapshotSource = {
			ref: { driver: "workspace", key: "k", bytes: snap.data!.length },
			read: async () => snap.data!,
		};
		const restored = await pool.acquire("ws:@node", {
			source: "restore",
			start: () => factory.restore(source),
		});
		expect(restored.source).toBe("restore");
		expect(await run(restored.sandbox, "cat f")).toBe("state\n");

		pool.warm("ws:", { kind: "root", factory }, 1);
		await pool.settled();
		const hit = await pool.acquire("ws:", {
			source: "fresh",
			start: () => Promise.reject(new Error("a hit must not start one")),
		});
		expect(hit.source).toBe("pool");

		const stats = pool.stats();
		expect(stats).toMatchObject({ hits: 1, misses: 3 });
		expect(stats.starts.fresh?.count).toBe(1);
		expect(stats.starts.restore?.count).toBe(1);
		expect(stats.starts.pool?.count).toBe(1);

		await pool.drain();
		await Promise.all(
			[fresh, restored, hit].map(({ sandbox }) => sandbox.stop()),
		);
		expect(await dirs(root)).toBe(0);
	});

	it("reports the median of recorded start latencies per source", () => {
		const pool = new WarmPool({ maxTotal: 0 });
		for (const ms of [9, 1, 5, 7, 3]) pool.record("restore", ms);
		pool.record("fresh", 40);
		expect(pool.stats().starts).toEqual({
			restore: { count: 5, p50Ms: 5 },
			fresh: { count: 1, p50Ms: 40 },
		});
	});

	it("keeps forks of a hot state ready, each an independent copy, from one parent it never hands out", async () => {
		const root = await tmp("pool-fork");
		const factory = workspaceFactory({ root });
		const live = await factory.start();
		await run(live, "echo hot > state");
		let parents = 0;
		const spec: PoolSpec = {
			kind: "fork",
			parent: () => {
				parents++;
				return live.fork();
			},
		};
		const pool = new WarmPool({ maxTotal: 3 });
		pool.warm("ws:@hot", spec, 2);
		await pool.settled();
		// The live sandbox, the pool's parent and two forks.
		expect(await dirs(root)).toBe(4);
		// The live sandbox goes on; the pool's copies do not follow it.
		await run(live, "echo moved on > state");

		const a = pool.take("ws:@hot")!;
		expect(await run(a, "cat state")).toBe("hot\n");
		await run(a, "echo changed > state");
		const b = pool.take("ws:@hot")!;
		expect(await run(b, "cat state")).toBe("hot\n");
		await pool.settled();
		const c = pool.take("ws:@hot")!;
		expect(await run(c, "cat state")).toBe("hot\n");
		await pool.settled();
		expect(parents).toBe(1);
		expect(pool.stats().pools).toEqual([
			{ key: "ws:@hot", ready: 2, target: 2 },
		]);

		// Count 0 forgets the key: its forks and parent are stopped.
		pool.warm("ws:@hot", spec, 0);
		await pool.settled();
		expect(pool.stats()).toMatchObject({ pools: [], held: 0 });
		// Left: the live sandbox and the three taken.
		expect(await dirs(root)).toBe(4);
		await Promise.all([live, a, b, c].map((s) => s.stop()));
		expect(await dirs(root)).toBe(0);
	});

	it("never holds more than maxTotal, parents and sandboxes being made included, and gives freed room to a short key", async () => {
		const root = await tmp("pool-bound");
		const { factory, count, takeOver } = counting(workspaceFactory({ root }));
		const pool = new WarmPool({ maxTotal: 4, concurrency: 3 });
		const hot: PoolSpec = { kind: "fork", parent: () => factory.start() };
		const ready = () => pool.stats().pools.map((p) => p.ready);
		pool.warm("ws:", { kind: "root", factory }, 3);
		await pool.settled();
		// The fork key needs two slots (its parent and a fork); one is left.
		pool.warm("ws:@hot", hot, 2);
		await pool.settled();
		expect(ready()).toEqual([3, 0]);
		expect(pool.stats().held).toBe(3);

		// Lowering the root key's target stops its surplus at once, and the
		// room goes to the fork key.
		pool.warm("ws:", { kind: "root", factory }, 1);
		await pool.settled();
		expect(ready()).toEqual([1, 2]);
		expect(pool.stats().held).toBe(4);
		expect(count.live).toBe(4);

		// Each take frees a slot that the pool refills, never past the bound.
		for (let i = 0; i < 6; i++) {
			await takeOver(pool.take(i % 2 ? "ws:" : "ws:@hot")).stop();
			await pool.settled();
			expect(ready()).toEqual([1, 2]);
		}
		expect(count.live).toBe(4);
		expect(count.max).toBe(4);
		// One parent served every fork.
		expect(count.starts).toBe(3 + 1 + 3);
		expect(count.forks).toBe(2 + 3);

		await pool.drain();
		expect(count.live).toBe(0);
		expect(await dirs(root)).toBe(0);
	});

	it("drain stops everything it holds, sandboxes still being made included, and leaves taken ones alone", async () => {
		const root = await tmp("pool-drain");
		const factory = workspaceFactory({ root });
		const pool = new WarmPool({ maxTotal: 8, concurrency: 4 });
		pool.warm("ws:", { kind: "root", factory }, 2);
		await pool.settled();
		const taken = pool.take("ws:")!;
		const live = await factory.start();
		pool.warm("ws:@hot", { kind: "fork", parent: () => live.fork() }, 3);
		// No settling: the refill and the forks are under way.
		await pool.drain();
		expect(pool.stats()).toMatchObject({ pools: [], held: 0 });
		expect((await readdir(root)).sort()).toEqual(
			[taken, live]
				.map((s) => (s as unknown as { dir: string }).dir.split("/").pop())
				.sort(),
		);
		// Nothing comes back on its own.
		await pool.settled();
		expect(await dirs(root)).toBe(2);

		// A drained pool can be warmed again.
		pool.warm("ws:", { kind: "root", factory }, 1);
		await pool.settled();
		expect(await dirs(root)).toBe(3);
		await pool.drain();
		await Promise.all([taken.stop(), live.stop()]);
		expect(await dirs(root)).toBe(0);
	});

	it("stops trying a key whose make failed, reports it, and tries again when the key is taken from", async () => {
		let attempts = 0;
		const broken: SandboxFactory = {
			driver: "workspace",
			start: async () => {
				attempts++;
				throw new Error("no room at the inn");
			},
			restore: () => Promise.reject(new Error("unused")),
			mutates: () => true,
		};
		const errors: string[] = [];
		const pool = new WarmPool({
			maxTotal: 4,
			concurrency: 1,
			onError: (key, err) => errors.push(`${key}: ${(err as Error).message}`),
		});
		pool.warm("bad", { kind: "root", factory: broken }, 3);
		await pool.settled();
		expect(attempts).toBe(1);
		expect(errors).toEqual(["bad: no room at the inn"]);
		expect(pool.stats()).toMatchObject({ held: 0, misses: 0 });

		expect(pool.take("bad")).toBeNull();
		await pool.settled();
		expect(attempts).toBe(2);
		expect(pool.stats().misses).toBe(1);
	});

	it("refuses a count that is not a whole number", () => {
		const pool = new WarmPool({ maxTotal: 1 });
		const spec: PoolSpec = {
			kind: "root",
			factory: workspaceFactory({ root: "/nonexistent" }),
		};
		expect(() => pool.warm("k", spec, -1)).toThrow(RangeError);
		expect(() => pool.warm("k", spec, 1.5)).toThrow(RangeError);
		expect(pool.stats().pools).toEqual([]);
	});
});
