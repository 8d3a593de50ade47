/**
 * D1: what spans tasks. Projects, API keys (only their SHA-256 is stored) and
 * the task index that listing and the cron sweep page through. The tool call
 * graphs themselves live in the task graph Durable Objects, not here.
 */
import {
	index,
	integer,
	primaryKey,
	sqliteTable,
	text,
} from "drizzle-orm/sqlite-core";

export const projects = sqliteTable("projects", {
	id: text("id").primaryKey(),
	createdAt: integer("created_at").notNull(),
	/**
	 * JSON overrides of the default per-task budgets and project quotas
	 * (core/eviction.ts `Budgets`); null: the Worker's defaults.
	 */
	budgets: text("budgets"),
});

export const apiKeys = sqliteTable(
	"api_keys",
	{
		id: text("id").primaryKey(),
		projectId: text("project_id")
			.notNull()
			.references(() => projects.id),
		role: text("role", { enum: ["trainer", "host", "admin"] }).notNull(),
		name: text("name"),
		/** SHA-256 of the key, hex. Keys are 256-bit random, so no slow hash is needed. */
		hash: text("hash").notNull().unique(),
		createdAt: integer("created_at").notNull(),
		revokedAt: integer("revoked_at"),
		/**
		 * A rotated key's end of grace (ms since the epoch): it stops working
		 * then without being revoked. Null: no expiry.
		 */
		expiresAt: integer("expires_at"),
	},
	(t) => [index("api_keys_project").on(t.projectId)],
);

export const tasks = sqliteTable(
	"tasks",
	{
		projectId: text("project_id").notNull(),
		task: text("task").notNull(),
		createdAt: integer("created_at").notNull(),
		lastUsedAt: integer("last_used_at").notNull(),
		nodes: integer("nodes").notNull().default(0),
		snapshots: integer("snapshots").notNull().default(0),
		bytes: integer("bytes").notNull().default(0),
		lookups: integer("lookups").notNull().default(0),
		hits: integer("hits").notNull().default(0),
	},
	(t) => [
		primaryKey({ columns: [t.projectId, t.task] }),
		index("tasks_last_used").on(t.lastUsedAt),
	],
);

/**
 * Container hosts of a project. `secret` signs the Worker's requests to the
 * host (HMAC); it is issued at registration and must be kept in clear to sign.
 */
export const hosts = sqliteTable(
	"hosts",
	{
		id: text("id").primaryKey(),
		projectId: text("project_id").notNull(),
		url: text("url").notNull(),
		name: text("name"),
		capacity: integer("capacity").notNull(),
		/** JSON array of driver names. */
		drivers: text("drivers").notNull(),
		secret: text("secret").notNull(),
		/** `down` after a failed request, until its next heartbeat. */
		status: text("status", { enum: ["up", "down"] }).notNull(),
		lastSeenAt: integer("last_seen_at").notNull(),
		sandboxes: integer("sandboxes").notNull().default(0),
		busy: integer("busy").notNull().default(0),
		registeredAt: integer("registered_at").notNull(),
	},
	(t) => [index("hosts_project").on(t.projectId)],
);
