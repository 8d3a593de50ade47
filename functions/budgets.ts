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

const usageCache = new Map<
	string,
	{ at: number; tasks: Set<string>; bytes: number }
>();

/**
 * Refuses a record that would take a project past its quotas: a new task
 * past the task quota, or anything once the project's bytes are spent.
 * Reads the task index, which lags the task graphs by a few seconds.
 */
export async function quotaError(
	env: Env,
	project: string,
	task: string,
	budgets: Budgets,
): Promise<string | null> {
	let u = usageCache.get(project);
	if (!u || now() - u.at > 10_000) {
		const { results } = await env.DB.prepare(
			"select task, bytes from tasks where project_id = ?1",
		)
			.bind(project)
			.all<{ task: string; bytes: number }>();
		u = {
			at: now(),
			tasks: new Set(results.map((r) => r.task)),
			bytes: results.reduce((n, r) => n + r.bytes, 0),
		};
		usageCache.set(project, u);
	}
	if (u.bytes >= budgets.projectBytes) {
		return `the project holds ${u.bytes} bytes, its quota is ${budgets.projectBytes}`;
	}
	if (!u.tasks.has(task) && u.tasks.size >= budgets.tasks) {
		return `the project has ${u.tasks.size} tasks, its quota is ${budgets.tasks}`;
	}
	return null;
}
