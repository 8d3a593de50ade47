/**
 * Managed mode's wire format: rollouts whose tool calls Trellis executes on
 * container hosts. (Kept apart from core/api.ts because it needs the host
 * templates of core/host-api.ts.)
 */
import { z } from "zod";
import { Call } from "./api.ts";
import { Template } from "./host-api.ts";

export const OpenRolloutRequest = z
	.object({
		template: Template,
		/**
		 * Test mode: every hit is also executed in a fresh sandbox built by
		 * full replay, and the outputs are compared (counted in stats).
		 */
		oracle: z.boolean().optional(),
	})
	.strict();
export type OpenRolloutRequest = z.infer<typeof OpenRolloutRequest>;

export const RolloutCallRequest = Call.extend({
	timeoutMs: z.number().int().min(1).max(3_600_000).optional(),
}).strict();
export type RolloutCallRequest = z.infer<typeof RolloutCallRequest>;

export interface RolloutCallResponse {
	/** The call's result id, and the rollout's state after it. */
	id: string;
	state: string;
	output: string;
	exitCode: number;
	/** Answered from the cache (nothing ran for this rollout). */
	hit: boolean;
	/** A hit because another rollout was executing the same call right then. */
	coalesced: boolean;
	/** The call's recorded execution time. */
	execMs: number;
	/** Execution time this call did not spend (execMs on a hit, else 0). */
	savedMs: number;
	/** Time the server spent on the call, replay included. */
	tookMs: number;
	/** On a miss: how the sandbox got into the rollout's state. */
	plan: {
		kind: "live" | "warm" | "restore" | "fresh";
		from: number;
		replayed: number;
	} | null;
	/** Oracle mode, on a hit: whether a fresh full replay gave the same output. */
	oracle?: { match: boolean };
}

export interface RolloutSummary {
	id: string;
	state: string;
	calls: number;
	hits: number;
	coalesced: number;
	misses: number;
	savedMs: number;
	closed: boolean;
}
