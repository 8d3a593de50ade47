CREATE TABLE `leases` (
	`id` text PRIMARY KEY NOT NULL,
	`node_id` text NOT NULL,
	`expires_at` integer NOT NULL,
	`expired_at` integer
);
--> statement-breakpoint
CREATE INDEX `leases_expires` ON `leases` (`expires_at`);--> statement-breakpoint
CREATE INDEX `leases_node` ON `leases` (`node_id`);--> statement-breakpoint
CREATE TABLE `meta` (
	`key` text PRIMARY KEY NOT NULL,
	`value` text NOT NULL
);
--> statement-breakpoint
CREATE TABLE `nodes` (
	`seq` integer PRIMARY KEY AUTOINCREMENT NOT NULL,
	`id` text NOT NULL,
	`parent_id` text,
	`kind` text NOT NULL,
	`depth` integer NOT NULL,
	`tool` text,
	`args` text,
	`output` text,
	`output_key` text,
	`output_bytes` integer DEFAULT 0 NOT NULL,
	`exit_code` integer,
	`exec_ms` real DEFAULT 0 NOT NULL,
	`snapshot_driver` text,
	`snapshot_key` text,
	`snapshot_bytes` integer,
	`hits` integer DEFAULT 0 NOT NULL,
	`last_hit_at` integer,
	`created_at` integer NOT NULL
);
--> statement-breakpoint
CREATE UNIQUE INDEX `nodes_id_unique` ON `nodes` (`id`);--> statement-breakpoint
CREATE INDEX `nodes_parent` ON `nodes` (`parent_id`);--> statement-breakpoint
CREATE TABLE `tool_stats` (
	`tool` text PRIMARY KEY NOT NULL,
	`lookups` integer DEFAULT 0 NOT NULL,
	`hits` integer DEFAULT 0 NOT NULL,
	`misses` integer DEFAULT 0 NOT NULL,
	`saved_ms` real DEFAULT 0 NOT NULL,
	`records` integer DEFAULT 0 NOT NULL,
	`conflicts` integer DEFAULT 0 NOT NULL
);
