/**
 * The sandbox interface the cached executor runs tool calls over. A driver
 * (a directory workspace, a Docker container, a SQLite database) implements
 * {@link Sandbox}; a {@link SandboxFactory} starts fresh sandboxes and
 * restores them from snapshots. Drivers know nothing about HTTP: snapshots
 * come and go as bytes or driver-held handles, and the executor moves them
 * through the cache.
 */
import type { SnapshotRef } from "../core/api.ts";
import type { Call } from "../core/ids.ts";

export type { Call } from "../core/ids.ts";
export type { SnapshotRef } from "../core/api.ts";

/** What running one call in a sandbox gave. */
export interface ExecResult {
	/** stdout and stderr combined, as the agent sees them; valid Unicode. */
	output: string;
	exitCode: number;
	/** Wall-clock time of the call, in milliseconds. */
	execMs: number;
}

/**
 * A snapshot as a sandbox hands it out: the blob itself, which the executor
 * (or the host) uploads through the cache's snapshot route. The cache only
 * points nodes at blobs of its own (see the record route), so a handle a
 * driver keeps elsewhere is not a snapshot it can store.
 */
export interface SandboxSnapshot {
	driver: string;
	data: Uint8Array;
}

/**
 * A snapshot to restore: its ref as the cache returned it, and a way to get
 * its bytes. `read()` downloads lazily, so a driver that restores from its
 * own handle (`ref.key`) never pays for the download.
 */
export interface SnapshotSource {
	ref: SnapshotRef;
	read(): Promise<Uint8Array>;
}

/** One isolated, stateful environment that tool calls run in. */
export interface Sandbox {
	/** The driver's name, recorded in snapshot refs: `workspace`, `docker`, ... */
	readonly driver: string;
	/** Brings the sandbox up; a no-op when it is up already. */
	start(): Promise<void>;
	/** Runs one call. A failing command is a result (`exitCode`), not a throw. */
	exec(call: Call): Promise<ExecResult>;
	/** A new, started sandbox in the same state, independent from then on. */
	fork(): Promise<Sandbox>;
	/** The sandbox's current state, to restore later in this or another sandbox. */
	snapshot(): Promise<SandboxSnapshot>;
	/** Replaces the sandbox's state with a snapshot's. */
	restore(source: SnapshotSource): Promise<void>;
	/** Tears the sandbox down; it cannot be used afterwards. Idempotent. */
	stop(): Promise<void>;
	/**
	 * Whether a call changes the sandbox's state, used when the caller does
	 * not say. When unsure, say `true`: a read treated as a write costs hits;
	 * a write treated as a read returns wrong outputs.
	 */
	mutates(call: Call): boolean;
}

/** Starts sandboxes of one driver for the executor. */
export interface SandboxFactory {
	/** The driver of the sandboxes it starts; it restores only its own snapshots. */
	readonly driver: string;
	/** A fresh sandbox in the empty state, started. */
	start(): Promise<Sandbox>;
	/** A started sandbox in the state of a snapshot. */
	restore(source: SnapshotSource): Promise<Sandbox>;
	/** Whether a call changes state when the caller does not say (see {@link Sandbox.mutates}). */
	mutates(call: Call): boolean;
}

/**
 * A {@link SandboxFactory} over a constructor of unstarted sandboxes: `start`
 * starts one, `restore` starts one and restores the snapshot into it.
 */
export function sandboxFactory(
	create: () => Sandbox,
	options: { driver?: string; mutates?: (call: Call) => boolean } = {},
): SandboxFactory {
	// One idle instance answers `driver` and `mutates` without starting anything.
	const probe = create();
	return {
		driver: options.driver ?? probe.driver,
		async start() {
			const sandbox = create();
			await sandbox.start();
			return sandbox;
		},
		async restore(source) {
			const sandbox = create();
			await sandbox.start();
			try {
				await sandbox.restore(source);
			} catch (err) {
				await sandbox.stop();
				throw err;
			}
			return sandbox;
		},
		mutates: options.mutates ?? ((call) => probe.mutates(call)),
	};
}
