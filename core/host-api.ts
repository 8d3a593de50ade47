/**
 * The protocol between the Worker and container hosts.
 *
 * Host → Worker (with a `host` API key): register, heartbeat.
 * Worker → host (signed with `core/signing.ts`, the secret from registration):
 * sandbox operations. The Worker never executes tools itself.
 */
import { z } from "zod";
import { Call, Id, SnapshotRef, TaskName } from "./api.ts";

export const DRIVERS = ["docker", "workspace", "sqlite"] as const;
export const Driver = z.enum(DRIVERS);
export type Driver = z.infer<typeof Driver>;

/**
 * How to start a root sandbox. `name` picks what the host was configured
 * with for that driver: an image for docker (built locally), a seed
 * directory for workspace (optional), a database for sqlite (`chinook`).
 */
export const Template = z
	.object({
		driver: Driver,
		name: z
			.string()
			.regex(/^[A-Za-z0-9._:/-]{1,200}$/)
			.optional(),
		/** Docker only: attach a network (off by default: tools run offline). */
		network: z.boolean().optional(),
	})
	.strict();
export type Template = z.infer<typeof Template>;

// ------------------------------------------------------------ host → Worker

export const RegisterHostRequest = z
	.object({
		/** Where the Worker reaches the host (loopback in tests and locally). */
		url: z.url(),
		/** Sandboxes it runs at once. */
		capacity: z.number().int().min(1).max(100_000),
		drivers: z.array(Driver).min(1),
		name: z.string().max(200).optional(),
	})
	.strict();
export type RegisterHostRequest = z.infer<typeof RegisterHostRequest>;

export interface RegisterHostResponse {
	id: string;
	/** The HMAC secret the Worker signs its requests to this host with. */
	secret: string;
	/** Send a heartbeat at least this often, or be marked down. */
	heartbeatMs: number;
}

export const HeartbeatRequest = z
	.object({
		sandboxes: z.number().int().min(0),
		busy: z.number().int().min(0),
		pools: z.record(z.string(), z.number().int().min(0)).optional(),
	})
	.strict();
export type HeartbeatRequest = z.infer<typeof HeartbeatRequest>;

export interface HostInfo {
	id: string;
	url: string;
	name: string | null;
	capacity: number;
	drivers: Driver[];
	status: "up" | "down";
	lastSeenAt: number;
	sandboxes: number;
	busy: number;
}

// ------------------------------------------------------------ Worker → host

/** Where a snapshot blob lives, for the host to fetch with its own key. */
export const BlobSource = z
	.object({ task: TaskName, state: Id, ref: SnapshotRef })
	.strict();
export type BlobSource = z.infer<typeof BlobSource>;

/** `POST /sandboxes`: a fresh sandbox, or one restored from a snapshot. */
export const StartSandboxRequest = z
	.object({ template: Template, restore: BlobSource.optional() })
	.strict();
export type StartSandboxRequest = z.infer<typeof StartSandboxRequest>;

export interface StartSandboxResponse {
	id: string;
	/** pool: a warm sandbox or fork was ready; fresh: started now; restore: from the blob. */
	source: "pool" | "fresh" | "restore";
	startMs: number;
}

/** `POST /sandboxes/:id/exec`: one call. */
export const ExecRequest = z
	.object({
		call: Call,
		timeoutMs: z.number().int().min(1).max(3_600_000).optional(),
		maxOutputBytes: z
			.number()
			.int()
			.min(1)
			.max(64 << 20)
			.optional(),
	})
	.strict();
export type ExecRequest = z.infer<typeof ExecRequest>;

export interface ExecResponse {
	output: string;
	exitCode: number;
	execMs: number;
	timedOut: boolean;
	/** The driver's own verdict on whether the call changed state (sqlite decides this). */
	mutates?: boolean;
}

/** `POST /sandboxes/:id/fork` → a new sandbox in the same state. */
export interface ForkResponse {
	id: string;
	forkMs: number;
}

/**
 * `POST /sandboxes/:id/snapshot`: serialize the state and upload it to the
 * Worker's snapshot route for (task, state) with the host's key.
 */
export const SnapshotRequest = z.object({ task: TaskName, state: Id }).strict();
export type SnapshotRequest = z.infer<typeof SnapshotRequest>;
export type SnapshotResponse = SnapshotRef & { snapshotMs: number };

/**
 * `POST /pools/warm`: keep `count` ready copies of a template's root (no
 * `restore`) or of a snapshot (proactive forking of a hot node).
 */
export const WarmRequest = z
	.object({
		template: Template,
		restore: BlobSource.optional(),
		count: z.number().int().min(0).max(1000),
	})
	.strict();
export type WarmRequest = z.infer<typeof WarmRequest>;

/** `GET /health` (signed too). */
export interface HostHealth {
	drivers: Driver[];
	capacity: number;
	sandboxes: number;
	busy: number;
	pools: { key: string; ready: number; target: number }[];
	/** Start latencies by source (ms, p50). */
	starts: Record<string, { count: number; p50Ms: number }>;
	/** Sandboxes handed out from a warm pool, and requests a pool could not serve. */
	poolHits: number;
	poolMisses: number;
}
