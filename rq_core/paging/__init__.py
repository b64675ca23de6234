"""Expert paging: the page format (rq pack), the pager, the memory planner."""
