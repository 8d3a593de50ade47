/**
 * The task graph's hot statements, prepared once per object.
 *
 * drizzle builds a query's SQL from its expression tree on every call; on the
 * lookup and record paths that building cost more CPU than SQLite spent
 * running the statements. A prepared query is built once and then only binds
 * its placeholders (workerd keeps the compiled statement per SQL text).
 * Everything off the hot path keeps using the query builder directly.
 */
import { eq, getTableColumns, sql, type Column } from "drizzle-orm";
import type { DrizzleSqliteDODatabase } from "drizzle-orm/durable-sqlite";
import type * as schema from "./task-graph.schema.ts";
import { nodes, toolStats } from "./task-graph.schema.ts";

type Db = DrizzleSqliteDODatabase<typeof schema>;

/** The counters of `tool_stats` a statement may add to. */
export const TOOL_COUNTERS = [
	"lookups",
	"hits",
	"misses",
	"savedMs",
	"records",
	"conflicts",
	"coalesced",
	"oracleChecks",
	"oracleMismatches",
] as const;

const p = (name: string) => sql.placeholder(name);
/** `excluded.<column>` of an upsert: the value the insert tried to write. */
const excluded = (c: Column) => sql`excluded.${sql.identifier(c.name)}`;

export function prepareStatements(db: Db) {
	const nodeColumns = getTableColumns(nodes);
	return {
		/** The whole row of a node: `{ id }`. */
		node: db
			.select()
			.from(nodes)
			.where(eq(nodes.id, p("id")))
			.prepare(),

		/** A held call's identity, for replay: `{ id }`. */
		call: db
			.select({ tool: nodes.tool, args: nodes.args })
			.from(nodes)
			.where(eq(nodes.id, p("id")))
			.prepare(),

		/** Adds to a tool's counters, creating its row: `{ tool, ...counters }`. */
		bumpTool: db
			.insert(toolStats)
			.values({
				tool: p("tool"),
				...Object.fromEntries(TOOL_COUNTERS.map((k) => [k, p(k)])),
			})
			.onConflictDoUpdate({
				target: toolStats.tool,
				set: Object.fromEntries(
					TOOL_COUNTERS.map((k) => [
						k,
						sql`${toolStats[k]} + ${excluded(toolStats[k])}`,
					]),
				),
			})
			.prepare(),

		/** A new node: every column but `seq` and the counters, by name. */
		insertNode: db
			.insert(nodes)
			.values(
				Object.fromEntries(
					(
						[
							"id",
							"parentId",
							"kind",
							"depth",
							"tool",
							"args",
							"output",
							"outputKey",
							"outputBytes",
							"exitCode",
							"execMs",
							"snapshotDriver",
							"snapshotKey",
							"snapshotBytes",
							"createdAt",
						] as const satisfies readonly (keyof typeof nodeColumns)[]
					).map((k) => [k, p(k)]),
				) as unknown as typeof nodes.$inferInsert,
			)
			.prepare(),
	};
}

export type Statements = ReturnType<typeof prepareStatements>;
