CREATE TABLE `hosts` (
	`id` text PRIMARY KEY NOT NULL,
	`project_id` text NOT NULL,
	`url` text NOT NULL,
	`name` text,
	`capacity` integer NOT NULL,
	`drivers` text NOT NULL,
	`secret` text NOT NULL,
	`status` text NOT NULL,
	`last_seen_at` integer NOT NULL,
	`sandboxes` integer DEFAULT 0 NOT NULL,
	`busy` integer DEFAULT 0 NOT NULL,
	`registered_at` integer NOT NULL
);
--> statement-breakpoint
CREATE INDEX `hosts_project` ON `hosts` (`project_id`);