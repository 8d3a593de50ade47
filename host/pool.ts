/**
 * Warm pools: sandboxes started before anyone asks, so that a rollout rarely
 * waits for one (TVCache's proactive forking, generalized over drivers).
 *
 * A pool keeps, per key, a target number of ready sandboxes of one of two
 * kinds:
 * - `root`: fresh sandboxes of a template, made with `factory.start()`;
 * - `fork`: copies of one sandbox in a hot state (a snapshot node many
 *   rollouts reach). The pool loads that sandbox once with `parent()` (a
 *   restore from the node's snapshot, or a fork of a live sandbox at that
 *   state), keeps it as the fork parent, never hands it out, and refills by
 *   forking it: a fork is usually much cheaper than a restore.
 *
 * `take(key)` hands over a ready sandbox (it is the caller's from then on)
 * or says there is none, and refills in the background. Every sandbox the
 * pool holds (ready ones, fork parents, and those being made) counts against
 * one `maxTotal`, so a pool never grows past what the host can run. When the
 * total is reached, keys simply stay short; the caller lowers targets of
 * cold keys (count 0) to make room, since only it knows which nodes are hot.
 *
 * Generic over {@link SandboxFactory} and {@link Sandbox}: no driver, no HTTP.
 */
import type { Sandbox, SandboxFactory } from "../client/sandbox.ts";

/** Where a started sandbox came from, for start latencies. */
export type StartSource = "pool" | "fresh" | "restore";

/** How a pool key makes its sandboxes. */
export type PoolSpec =
	| {
			kind: "root";
			/** Makes each ready sandbox with `start()`. */
			factory: SandboxFactory;
	  }
	| {
			kind: "fork";
			/**
			 * Makes the fork parent, once: a sandbox in the key's state that
			 * the pool owns from then on (restore it from a snapshot, or fork
			 * a live sandbox; never hand over one that will go on changing).
			 */
			parent: () => Promise<Sandbox>;
	  };

/** Options of a {@link WarmPool}. */
export interface PoolOptions {
	/** The most sandboxes the pool holds at once over all keys: ready, parents, being made. */
	maxTotal: number;
	/** Sandboxes made at once while refilling (default 2). */
	concurrency?: number;
	/** Told about failures in the background: a make, a parent, a stop. */
	onError?: (key: string, err: unknown) => void;
}

/** A sandbox handed out by {@link WarmPool.acquire}, and how it got there. */
export interface Acquired {
	sandbox: Sandbox;
	source: StartSource;
	/** Time from asking to having it, in ms. */
	startMs: number;
}

/** What {@link WarmPool.stats} reports. */
export interface PoolStats {
	/** Per key: sandboxes ready and the target. */
	pools: { key: string; ready: number; target: number }[];
	/** Start latencies by source (ms; the p50 of the most recent samples). */
	starts: Partial<Record<StartSource, { count: number; p50Ms: number }>>;
	/** `take` calls that got a sandbox, and that did not. */
	hits: number;
	misses: number;
	/** Sandboxes the pool holds now (ready, parents, being made). */
	held: number;
}

interface Entry {
	key: string;
	spec: PoolSpec;
	target: number;
	ready: Sandbox[];
	making: number;
	/** The fork parent, loading or loaded; counts as held once set. */
	parent?: Promise<Sandbox>;
	/** A make failed: no more tries until the key is warmed or taken from again. */
	failed: boolean;
}

const LATENCY_SAMPLES = 1024;

/** Warm pools over any sandbox factory; see the module comment. */
export class WarmPool {
	readonly #maxTotal: number;
	readonly #concurrency: number;
	readonly #onError: (key: string, err: unknown) => void;
	readonly #entries = new Map<string, Entry>();
	/** Makes and stops under way, for `settled()` and `drain()`. */
	readonly #work = new Set<Promise<unknown>>();
	#making = 0;
	/** Sandboxes being stopped: still running, so still counted as held. */
	#stopping = 0;
	#hits = 0;
	#misses = 0;
	readonly #latencies = new Map<StartSource, number[]>();

	/** Starts nothing until a key is warmed. */
	constructor(options: PoolOptions) {
		if (!(options.maxTotal >= 0))
			throw new RangeError("maxTotal must be a number of sandboxes");
		this.#maxTotal = options.maxTotal;
		this.#concurrency = Math.max(1, options.concurrency ?? 2);
		this.#onError = options.onError ?? (() => {});
	}

	/**
	 * Keeps `count` sandboxes ready under `key`, made as `spec` says; the
	 * fill happens in the background. A key's spec is fixed when it is first
	 * warmed (a key names one state); later calls change its target. Count 0
	 * forgets the key and stops what it held. Lowering a target stops the
	 * surplus at once.
	 */
	warm(key: string, spec: PoolSpec, count: number): void {
		if (!Number.isInteger(count) || count < 0)
			throw new RangeError("a pool's count must be a whole number");
		let entry = this.#entries.get(key);
		if (count === 0) {
			if (entry) this.#forget(entry);
			return;
		}
		if (!entry) {
			entry = { key, spec, target: count, ready: [], making: 0, failed: false };
			this.#entries.set(key, entry);
		}
		entry.target = count;
		entry.failed = false;
		for (const surplus of entry.ready.splice(count)) this.#stop(key, surplus);
		this.#pump();
	}

	/**
	 * A ready sandbox of `key`, now the caller's, or null when none is ready
	 * (a miss). Either way the key refills in the background.
	 */
	take(key: string): Sandbox | null {
		const started = performance.now();
		const entry = this.#entries.get(key);
		const sandbox = entry?.ready.shift() ?? null;
		if (entry) entry.failed = false;
		if (sandbox === null) {
			this.#misses++;
		} else {
			this.#hits++;
			this.record("pool", performance.now() - started);
		}
		// Refill once the caller has taken the sandbox over: a caller that
		// counts what runs (the host's capacity) would otherwise see the
		// sandbox and its replacement at once.
		queueMicrotask(() => this.#pump());
		return sandbox;
	}

	/**
	 * A started sandbox for `key`: a ready one from the pool, or else one
	 * made now by `miss.start` (counted as `miss.source`). Records the start
	 * latency either way.
	 */
	async acquire(
		key: string,
		miss: {
			source: Exclude<StartSource, "pool">;
			start: () => Promise<Sandbox>;
		},
	): Promise<Acquired> {
		const started = performance.now();
		const ready = this.take(key);
		if (ready !== null)
			return {
				sandbox: ready,
				source: "pool",
				startMs: performance.now() - started,
			};
		const sandbox = await miss.start();
		const startMs = performance.now() - started;
		this.record(miss.source, startMs);
		return { sandbox, source: miss.source, startMs };
	}

	/** Records a start latency made outside the pool (a fresh start, a restore). */
	record(source: StartSource, ms: number): void {
		let samples = this.#latencies.get(source);
		if (!samples) this.#latencies.set(source, (samples = []));
		samples.push(ms);
		if (samples.length > LATENCY_SAMPLES) samples.shift();
	}

	/** Pool sizes, hits and misses, and start latencies by source. */
	stats(): PoolStats {
		const starts: PoolStats["starts"] = {};
		for (const [source, samples] of this.#latencies)
			starts[source] = { count: samples.length, p50Ms: median(samples) };
		return {
			pools: [...this.#entries.values()].map((e) => ({
				key: e.key,
				ready: e.ready.length,
				target: e.target,
			})),
			starts,
			hits: this.#hits,
			misses: this.#misses,
			held: this.#held(),
		};
	}

	/** Resolves once no make or stop is under way (every key full, or stuck). */
	async settled(): Promise<void> {
		while (this.#work.size > 0) await Promise.allSettled([...this.#work]);
	}

	/**
	 * Forgets every key and stops everything the pool holds, waiting for
	 * sandboxes being made to finish and stopping them too. Sandboxes already
	 * taken are the caller's and keep running. The pool can be warmed again.
	 */
	async drain(): Promise<void> {
		for (const entry of [...this.#entries.values()]) this.#forget(entry);
		await this.settled();
	}

	#held(): number {
		// Makes and stops count globally: those of a forgotten key hold a
		// sandbox as much as any other until they finish.
		let held = this.#making + this.#stopping;
		for (const e of this.#entries.values())
			held += e.ready.length + (e.parent ? 1 : 0);
		return held;
	}

	/** Starts makes while some key is short and the bounds allow. */
	#pump(): void {
		while (this.#making < this.#concurrency) {
			const held = this.#held();
			let pick: Entry | undefined;
			for (const e of this.#entries.values()) {
				if (e.failed || e.ready.length + e.making >= e.target) continue;
				// A fork key without its parent needs a slot for that too.
				const slots = e.spec.kind === "fork" && !e.parent ? 2 : 1;
				if (held + slots > this.#maxTotal) continue;
				// The shortest key first, so one hot key does not starve others.
				if (
					!pick ||
					e.ready.length + e.making < pick.ready.length + pick.making
				)
					pick = e;
			}
			if (!pick) return;
			this.#track(this.#make(pick));
		}
	}

	async #make(entry: Entry): Promise<void> {
		this.#making++;
		entry.making++;
		const spec = entry.spec;
		if (spec.kind === "fork" && !entry.parent) {
			const parent = spec.parent();
			entry.parent = parent;
			// A parent that fails is dropped, so a later warm tries again.
			parent.catch(() => {
				if (entry.parent === parent) entry.parent = undefined;
			});
		}
		let made: Sandbox | null = null;
		try {
			made =
				spec.kind === "root"
					? await spec.factory.start()
					: await (await entry.parent!).fork();
		} catch (err) {
			entry.failed = true;
			// A key forgotten meanwhile may fail by design (its parent was
			// stopped under the fork); that is nobody's news.
			if (this.#entries.get(entry.key) === entry) this.#onError(entry.key, err);
		} finally {
			this.#making--;
			entry.making--;
		}
		if (made !== null) {
			const wanted =
				this.#entries.get(entry.key) === entry &&
				entry.ready.length < entry.target;
			if (wanted) entry.ready.push(made);
			else this.#stop(entry.key, made);
		}
		this.#pump();
	}

	#forget(entry: Entry): void {
		if (this.#entries.get(entry.key) === entry) this.#entries.delete(entry.key);
		entry.target = 0;
		for (const sandbox of entry.ready.splice(0)) this.#stop(entry.key, sandbox);
		const parent = entry.parent;
		entry.parent = undefined;
		if (!parent) return;
		// Counted as stopping while it may still be loading.
		this.#stopping++;
		this.#track(
			parent
				.then((p) => p.stop())
				.catch((err: unknown) => this.#onError(entry.key, err))
				.finally(() => {
					this.#stopping--;
					this.#pump();
				}),
		);
	}

	#stop(key: string, sandbox: Sandbox): void {
		this.#stopping++;
		this.#track(
			sandbox
				.stop()
				.catch((err: unknown) => this.#onError(key, err))
				.finally(() => {
					this.#stopping--;
					// A freed slot may let a short key fill.
					this.#pump();
				}),
		);
	}

	#track(work: Promise<unknown>): void {
		this.#work.add(work);
		const done = () => this.#work.delete(work);
		work.then(done, done);
	}
}

/** The lower median, as the host reports it. */
function median(samples: readonly number[]): number {
	if (samples.length === 0) return 0;
	const sorted = [...samples].sort((a, b) => a - b);
	return sorted[Math.floor((sorted.length - 1) / 2)]!;
}
