/**
 * The cron sweep. Today it pages through the task index and lets each task
 * graph expire its due leases (its alarm does the same; running both is
 * harmless). Budgets, idle-task expiry and orphaned-blob cleanup are not
 * built yet (see the README).
 */
export async function sweep(env: Env, _scheduledTime: number): Promise<void> {
	let after = "";
	for (;;) {
		const { results } = await env.DB.prepare(
			"select project_id, task from tasks where project_id || '/' || task > ?1 order by project_id || '/' || task limit 100",
		)
			.bind(after)
			.all<{ project_id: string; task: string }>();
		if (results.length === 0) return;
		for (const r of results) {
			const name = `${r.project_id}/${r.task}`;
			await env.TASK_GRAPH.get(env.TASK_GRAPH.idFromName(name)).sweep();
			after = name;
		}
	}
}
