/**
 * The Trellis TypeScript client: the HTTP API, canonical ids, the sandbox
 * interface and the cached-execution loop.
 */
export {
	TrellisClient,
	TrellisError,
	type LookupInput,
	type RecordInput,
	type TrellisClientOptions,
} from "./http.ts";
export {
	CachedToolExecutor,
	type CallOptions,
	type CallResult,
	type ExecutorOptions,
	type RolloutCounters,
	type SnapshotInfo,
} from "./executor.ts";
export {
	sandboxFactory,
	type ExecResult,
	type Sandbox,
	type SandboxFactory,
	type SandboxSnapshot,
	type SnapshotSource,
} from "./sandbox.ts";
// Ids come from the one implementation the server uses too.
export {
	ROOT_ID,
	callKey,
	canonicalCall,
	childId,
	finalState,
	mutates,
	obsId,
	pathIds,
	type Call,
	type PathStep,
} from "../core/ids.ts";
export type * from "../core/api.ts";
