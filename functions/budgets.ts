/**
 * A project's budgets: its overrides in D1 on top of the Worker's defaults
 * (wrangler.toml `[vars]`). Remembered per isolate for a short while, since
 * records read them and budgets change rarely.
 */
import { z } from "zod";
import { now } from "../core/clock.ts";
import type { Budgets } from "../core/eviction.ts";

const CACHE_MS = 30_000;
const cache = new Map<string, { at: number; budgets: Budgets }>();

const count = z.number().int().min(0);
/** What a project may override; any subset. */
export const BudgetOverrides = z
	.object({
		snapshots: count,
		snapshotBytes: count,
		nodes: count.min(1),
		outputBytes: count,
		tasks: count.min(1),
		projectBytes: count,
	})
	.partial()
	.strict();
export type BudgetOverrides = z.infer<typeof BudgetOverrides>;

export function defaultBudgets(env: Env): Budgets {
	return {
		snapshots: Number(env.BUDGET_SNAPSHOTS),
		snapshotBytes: Number(env.BUDGET_SNAPSHOT_BYTES),
		nodes: Number(env.BUDGET_NODES),
		outputBytes: Number(env.BUDGET_OUTPUT_BYTES),
		tasks: Number(env.QUOTA_TASKS),
		projectBytes: Number(env.QUOTA_BYTES),
	};
}

export async function budgetsFor(env: Env, project: string): Promise<Budgets> {
	const hit = cache.get(project);
	if (hit && now() - hit.at < CACHE_MS) return hit.budgets;
	const row = await env.DB.prepare("select budgets from projects where id = ?1")
		.bind(project)
		.first<{ budgets: string | null }>();
	const overrides = BudgetOverrides.safeParse(JSON.parse(row?.budgets ?? "{}"));
	const budgets = {
		...defaultBudgets(env),
		...(overrides.success ? overrides.data : {}),
	};
	cache.set(project, { at: now(), budgets });
	return budgets;
}

export function forgetBudgets(project: string): void {
	cache.delete(project);
}

/**
 * A project's task count and bytes, from the task index, per isolate, and
 * the tasks seen indexed since (asked only at the task quota).
 */
const usageCache = new Map<
	string,
	{ at: number; tasks: number; bytes: number; indexed: Set<string> }
>();
const USAGE_CACHE_MS = 10_000;

/**
 * Refuses a record or an upload that would take a project past its quotas:
 * a new task past the task quota; anything once the project's bytes are
 * spent, or, for an upload of `adding` bytes, a blob that would spend them.
 * Reads the task index, which lags the task graphs by a few seconds: one
 * aggregate row per project every USAGE_CACHE_MS, and whether this task is
 * indexed only when the task quota is reached (once per task in that time).
 */
export async function quotaError(
	env: Env,
	project: string,
	task: string,
	budgets: Budgets,
	adding = 0,
): Promise<string | null> {
	let u = usageCache.get(project);
	if (!u || now() - u.at > USAGE_CACHE_MS) {
		const row = await env.DB.prepare(
			`select count(*) as tasks, coalesce(sum(bytes), 0) as bytes
			 from tasks where project_id = ?1`,
		)
			.bind(project)
			.first<{ tasks: number; bytes: number }>();
		u = {
			at: now(),
			tasks: row?.tasks ?? 0,
			bytes: row?.bytes ?? 0,
			indexed: new Set(),
		};
		usageCache.set(project, u);
	}
	if (u.bytes >= budgets.projectBytes) {
		return `the project holds ${u.bytes} bytes, its quota is ${budgets.projectBytes}`;
	}
	if (u.bytes + adding > budgets.projectBytes) {
		return `the project holds ${u.bytes} bytes; ${adding} more would pass its quota of ${budgets.projectBytes}`;
	}
	if (u.tasks >= budgets.tasks && !u.indexed.has(task)) {
		// At the quota every record asks; a task found indexed is remembered
		// as long as the counts are, so its later records do not.
		const known = await env.DB.prepare(
			"select 1 as known from tasks where project_id = ?1 and task = ?2",
		)
			.bind(project, task)
			.first<{ known: number }>();
		if (!known) {
			return `the project has ${u.tasks} tasks, its quota is ${budgets.tasks}`;
		}
		u.indexed.add(task);
	}
	return null;
}
