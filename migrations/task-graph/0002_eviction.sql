CREATE TABLE `evictions` (
	`reason` text PRIMARY KEY NOT NULL,
	`count` integer DEFAULT 0 NOT NULL,
	`bytes` integer DEFAULT 0 NOT NULL
);
--> statement-breakpoint
ALTER TABLE `nodes` ADD `restores` integer DEFAULT 0 NOT NULL;--> statement-breakpoint
ALTER TABLE `nodes` ADD `last_restored_at` integer;