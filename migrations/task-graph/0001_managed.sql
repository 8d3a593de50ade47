CREATE TABLE `costs` (
	`key` text PRIMARY KEY NOT NULL,
	`ms` real NOT NULL,
	`samples` integer NOT NULL
);
--> statement-breakpoint
CREATE TABLE `rollouts` (
	`id` text PRIMARY KEY NOT NULL,
	`template` text NOT NULL,
	`state` text NOT NULL,
	`host_id` text,
	`sandbox_id` text,
	`sandbox_state` text,
	`oracle` integer DEFAULT false NOT NULL,
	`calls` integer DEFAULT 0 NOT NULL,
	`hits` integer DEFAULT 0 NOT NULL,
	`coalesced` integer DEFAULT 0 NOT NULL,
	`misses` integer DEFAULT 0 NOT NULL,
	`saved_ms` real DEFAULT 0 NOT NULL,
	`created_at` integer NOT NULL,
	`closed_at` integer
);
--> statement-breakpoint
ALTER TABLE `nodes` ADD `policy_replay_ms` real;--> statement-breakpoint
ALTER TABLE `nodes` ADD `policy_cost_ms` real;--> statement-breakpoint
ALTER TABLE `nodes` ADD `policy_snapshot` integer;--> statement-breakpoint
CREATE INDEX `nodes_output_key` ON `nodes` (`output_key`);--> statement-breakpoint
ALTER TABLE `tool_stats` ADD `coalesced` integer DEFAULT 0 NOT NULL;--> statement-breakpoint
ALTER TABLE `tool_stats` ADD `oracle_checks` integer DEFAULT 0 NOT NULL;--> statement-breakpoint
ALTER TABLE `tool_stats` ADD `oracle_mismatches` integer DEFAULT 0 NOT NULL;