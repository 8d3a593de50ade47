/**
 * The cron sweep: pages through the task index and has each task graph
 * expire leases, delete itself when idle past the TTL, enforce its budgets
 * and delete blobs no node points at (after a grace period, so an upload
 * whose record is on its way is not taken for one). Running two sweeps at
 * once is safe: each task graph serializes its own sweep and every step is
 * idempotent.
 */
import { budgetsFor } from "./budgets.ts";

export interface SweepReport {
	tasks: number;
	deleted: number;
	evictedSnapshots: number;
	evictedNodes: number;
	orphans: number;
	bytes: number;
}

export async function sweep(
	env: Env,
	_scheduledTime: number,
): Promise<SweepReport> {
	const report = {
		tasks: 0,
		deleted: 0,
		evictedSnapshots: 0,
		evictedNodes: 0,
		orphans: 0,
		bytes: 0,
	};
	let after = "";
	for (;;) {
		const { results } = await env.DB.prepare(
			`select project_id, task, project_id || '/' || task as name from tasks
			 where project_id || '/' || task > ?1 order by name limit 100`,
		)
			.bind(after)
			.all<{ project_id: string; task: string; name: string }>();
		if (results.length === 0) return report;
		for (const r of results) {
			after = r.name;
			const graph = env.TASK_GRAPH.get(env.TASK_GRAPH.idFromName(r.name));
			const res = await graph.sweep({
				budgets: await budgetsFor(env, r.project_id),
				idleTtlMs: Number(env.IDLE_TASK_TTL_MS),
				orphanGraceMs: Number(env.ORPHAN_GRACE_MS),
			});
			report.tasks++;
			if (res.deleted) report.deleted++;
			report.evictedSnapshots += res.evicted.snapshots;
			report.evictedNodes += res.evicted.nodes;
			report.orphans += res.evicted.orphans;
			report.bytes += res.evicted.bytes;
		}
	}
}
