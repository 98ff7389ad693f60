//! Leases: when a ticket stops being active by itself.
//!
//! A ticket started with a lease (or under `quota.default_lease`) has a `lease_until`.
//! From that instant on it is no longer active, whether or not anyone has written that
//! down yet: it has ended, with outcome `expired`, at `lease_until`, and it stays
//! retained for `quota.retention` from then, like a ticket finished at that instant.
//! The ledger writer later writes the outcome into the row (the expiry sweep), but
//! counting never waits for it. Times are PostgreSQL timestamps (microseconds).

/// When a ticket ended as of `now`: when it was finished, or when its lease ran out if
/// that is already past; `None` while it is active.
pub fn effective_end(ended_at: Option<i64>, lease_until: Option<i64>, now: i64) -> Option<i64> {
    ended_at.or(lease_until.filter(|&l| l <= now))
}

/// Whether a ticket is active at `now`.
pub fn is_active(ended_at: Option<i64>, lease_until: Option<i64>, now: i64) -> bool {
    effective_end(ended_at, lease_until, now).is_none()
}

/// Whether a ticket is retained at `now` for tickets that ended at or after `cutoff`.
pub fn is_retained(ended_at: Option<i64>, lease_until: Option<i64>, now: i64, cutoff: i64) -> bool {
    effective_end(ended_at, lease_until, now).is_none_or(|end| end >= cutoff)
}

/// What a ticket looks like to a reader at `now`: the outcome `expired` for a lease
/// that ran out before anyone finished the ticket.
pub fn shown_outcome<'a>(
    outcome: Option<&'a str>,
    ended_at: Option<i64>,
    lease_until: Option<i64>,
    now: i64,
) -> Option<&'a str> {
    match (ended_at, effective_end(ended_at, lease_until, now)) {
        (None, Some(_)) => Some("expired"),
        _ => outcome,
    }
}

/// A role's active tickets whose lease ran out, as their expiries: not active any more,
/// and, once an expiry is older than a retention cutoff, not retained either. Counting
/// still sees them until the ledger writer's sweep writes them down.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lapsed {
    /// Each one's expiry, ascending, and weight (0.7.0).
    expiries: Vec<(i64, i64)>,
    /// Their units (0.7.0: the sum of their weights).
    units: i64,
}

impl Lapsed {
    /// From each lapsed ticket's expiry and weight.
    pub fn new(lapsed: Vec<(i64, i64)>) -> Lapsed {
        let units = lapsed.iter().map(|&(_, w)| w).sum();
        let mut expiries = lapsed;
        expiries.sort_unstable();
        Lapsed { expiries, units }
    }

    /// Their units: none of them is active.
    pub fn expired(&self) -> i64 {
        self.units
    }

    /// The units of those that expired before `cutoff`: not retained either.
    pub fn aged_out(&self, cutoff: i64) -> i64 {
        self.expiries[..self.first_retained(cutoff)]
            .iter()
            .map(|&(_, w)| w)
            .sum()
    }

    /// Those that expired at or after `cutoff` (still retained), as (expiry, weight),
    /// ascending.
    pub fn retained_from(&self, cutoff: i64) -> &[(i64, i64)] {
        &self.expiries[self.first_retained(cutoff)..]
    }

    fn first_retained(&self, cutoff: i64) -> usize {
        self.expiries.partition_point(|&(e, _)| e < cutoff)
    }
}

/// How capacity returns at a retained limit for a refused start (0.7.0), which its
/// HINT says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgeOut {
    /// When the oldest retained ticket ages out (`Capacity::at`), which frees enough.
    Oldest,
    /// When enough of several tickets' units have aged out (`Capacity::at`).
    Enough,
    /// Nothing retained has ended yet: every retained ticket is active.
    NoneEnded,
    /// The tickets that ended free too few units as they age out: the rest of the
    /// count is active tickets, which must finish first.
    TooFew,
    /// More tickets than `AGE_OUT_READS` would have to age out: not read further.
    Beyond,
}

/// How many of a scope's ended tickets a refusal reads, oldest first, to say when
/// enough have aged out (0.7.0): a count far above its limit (one lowered since) or a
/// weight of 1,000,000 over tickets of weight 1 would read a whole history otherwise.
pub const AGE_OUT_READS: usize = 10_000;

/// How and when capacity returns (`at`, before the retention is added: when the last
/// ticket it needs ended).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    pub how: AgeOut,
    pub at: Option<i64>,
}

impl Capacity {
    fn without_time(how: AgeOut) -> Capacity {
        Capacity { how, at: None }
    }

    /// This, `secs` later (a retention).
    pub fn after(self, secs: i64) -> Capacity {
        Capacity {
            at: self
                .at
                .map(|t| t.saturating_add(secs.saturating_mul(1_000_000))),
            ..self
        }
    }
}

/// When capacity returns for a start that needs `need` more units below a retained
/// limit (its weight and what the count takes past the limit; below 1 it asks for the
/// oldest), from the scope's ended units still retained (`ended_units`: the count less
/// its active units) and those tickets, each as (when it ended, its weight), ascending:
/// the finished or swept ones that `read(need)` gives (reading until their units make
/// `need`, and saying whether it stopped at AGE_OUT_READS first), called only where
/// the ended units could make room; and `lapsed` (their lease ran out, not swept yet).
/// They age out in the order they ended, so the answer is the end of the one whose
/// units bring them to `need`.
pub fn capacity(
    need: i64,
    ended_units: i64,
    read: impl FnOnce(i64) -> (Vec<(i64, i64)>, bool),
    lapsed: &[(i64, i64)],
) -> Capacity {
    let need = need.max(1);
    if ended_units <= 0 {
        return Capacity::without_time(AgeOut::NoneEnded);
    }
    if need > ended_units {
        return Capacity::without_time(AgeOut::TooFew);
    }
    let (ended, capped) = read(need);
    let (mut e, mut l) = (ended.iter().peekable(), lapsed.iter().peekable());
    let (mut freed, mut read) = (0i64, 0usize);
    loop {
        let next = match (e.peek(), l.peek()) {
            (Some(a), Some(b)) if a.0 <= b.0 => e.next(),
            (Some(_), Some(_)) => l.next(),
            (Some(_), None) => e.next(),
            // Past the last ticket read, unread ones may have ended before the next
            // lapsed lease.
            (None, _) if capped => None,
            (None, _) => l.next(),
        };
        let Some(&(at, weight)) = next else {
            let how = if capped {
                AgeOut::Beyond
            } else {
                AgeOut::TooFew
            };
            return Capacity::without_time(how);
        };
        read += 1;
        freed = freed.saturating_add(weight);
        if freed >= need {
            let how = if read == 1 {
                AgeOut::Oldest
            } else {
                AgeOut::Enough
            };
            return Capacity { how, at: Some(at) };
        }
    }
}

/// PostgreSQL's end of time (DT_NOEND, `'infinity'`), which a lease of `'infinity'`
/// (PostgreSQL 17's infinite intervals) ends at.
pub const INFINITY: i64 = i64::MAX;
/// The first instant past the last valid timestamp (END_TIMESTAMP, 294277-01-01).
pub const END_TIMESTAMP: i64 = 9_223_371_331_200_000_000;

/// A lease as a length, from the `lease_until` its caller computed at `now`: what the
/// request carries, so that the writer can end it that long after the ticket starts.
/// An infinite lease stays infinite (INFINITY).
pub fn length(now: i64, until: i64) -> i64 {
    if until == INFINITY {
        INFINITY
    } else {
        until.saturating_sub(now)
    }
}

/// When a lease of `length` (see `length`) ends for a ticket that starts at `start`:
/// never past the last valid timestamp, so that a clock later than the caller's (or a
/// clock step) cannot make it an instant PostgreSQL rejects on output or restore.
pub fn ends(start: i64, length: i64) -> i64 {
    if length == INFINITY {
        INFINITY
    } else {
        start.saturating_add(length).min(END_TIMESTAMP - 1)
    }
}

/// The earlier of two optional instants.
pub fn earliest(a: Option<i64>, b: Option<i64>) -> Option<i64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// How long a waiting start() sleeps before it looks again, in milliseconds: until
/// its deadline, or until the earliest lease in its way runs out (plus one
/// millisecond, so that the lease is past when it looks), whichever comes first, and
/// never longer than `poll_ms`, so that a wake-up that was missed costs at most that.
/// A finish() that frees a slot wakes the waiter at once in any case.
pub fn wait_ms(now: i64, deadline: i64, next_expiry: Option<i64>, poll_ms: i64) -> i64 {
    let until = next_expiry.map_or(deadline, |e| deadline.min(e.saturating_add(1000)));
    let ms = (until.saturating_sub(now) + 999) / 1000;
    ms.clamp(0, poll_ms)
}

/// How long the writer waits between the starts of two expiry sweeps, given that the
/// last one took `took`: `every`, or `share` times as long as the last sweep if that
/// is longer, so that sweeping takes at most 1/`share` of the writer's time however
/// many unended tickets each sweep reads; never more than a minute, so that leases are
/// still written down (each sweep ends at most sweep.rs's MAX_DUE of them).
pub fn sweep_pause(
    took: std::time::Duration,
    every: std::time::Duration,
    share: u32,
) -> std::time::Duration {
    every
        .max(took.saturating_mul(share))
        .min(SWEEP_PAUSE_MAX.max(every))
}

/// The longest pause between two expiry sweeps (`sweep_pause`).
pub const SWEEP_PAUSE_MAX: std::time::Duration = std::time::Duration::from_secs(60);

/// When a start() with a wait of `wait_us` stops waiting for capacity, counted from
/// `now()`, the clock when it was called (read only for a start that waits): None
/// where it does not wait (a wait of zero, start()'s default), and then it gives up at
/// its first refusal whatever the clock reads afterwards: judged by a second reading, a
/// clock stepped back between the two would send it into line until the clock caught
/// up again.
pub fn deadline(wait_us: i64, now: impl FnOnce() -> i64) -> Option<i64> {
    (wait_us > 0).then(|| now().saturating_add(wait_us))
}

/// An interval as a wait in microseconds: months count 30 days and days 24 hours, as
/// PostgreSQL's `interval` comparisons count them (a wait does not follow the
/// calendar), saturating instead of overflowing, so that a wait of any size works.
/// None when it is negative.
pub fn wait_micros(months: i32, days: i32, micros: i64) -> Option<i64> {
    const DAY: i128 = 86_400_000_000;
    let total = i128::from(months) * 30 * DAY + i128::from(days) * DAY + i128::from(micros);
    (total >= 0).then(|| total.min(i128::from(i64::MAX)) as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 0.4.1 (F1): the lease is a length from the ticket's start; an infinite one stays
    /// infinite, and none ends past the last valid timestamp.
    #[test]
    fn a_lease_runs_its_length_from_the_start() {
        assert_eq!(ends(500, length(100, 300)), 700);
        assert_eq!(ends(500, length(100, INFINITY)), INFINITY);
        assert_eq!(
            ends(END_TIMESTAMP - 10, length(0, END_TIMESTAMP - 20)),
            END_TIMESTAMP - 1
        );
        assert!(ends(i64::MAX - 5, 100) < END_TIMESTAMP);
    }
    use proptest::prelude::*;

    /// A start without a wait never waits: no deadline to judge against a clock that
    /// may have stepped back since it was read.
    #[test]
    fn a_start_without_a_wait_has_no_deadline() {
        assert_eq!(
            deadline(0, || unreachable!(
                "no clock for a start that does not wait"
            )),
            None
        );
        assert_eq!(deadline(1, || 1_000), Some(1_001));
        assert_eq!(deadline(10, || i64::MAX - 1), Some(i64::MAX));
    }

    #[test]
    fn a_lease_in_the_future_keeps_the_ticket_active() {
        assert!(is_active(None, Some(100), 99));
        assert!(is_active(None, None, i64::MAX));
    }

    #[test]
    fn a_lease_that_ran_out_ends_the_ticket_at_its_expiry() {
        assert!(!is_active(None, Some(100), 100));
        assert_eq!(effective_end(None, Some(100), 500), Some(100));
        assert_eq!(shown_outcome(None, None, Some(100), 100), Some("expired"));
        assert_eq!(shown_outcome(None, None, Some(100), 99), None);
    }

    #[test]
    fn a_finished_ticket_keeps_its_own_end_and_outcome() {
        assert_eq!(effective_end(Some(50), Some(100), 500), Some(50));
        assert_eq!(
            shown_outcome(Some("failed"), Some(50), Some(10), 500),
            Some("failed")
        );
    }

    #[test]
    fn an_expired_ticket_stays_retained_for_the_retention_from_its_expiry() {
        // Expired at 100; retention 50: retained while the cutoff (now - 50) <= 100.
        assert!(is_retained(None, Some(100), 150, 100));
        assert!(!is_retained(None, Some(100), 151, 101));
    }

    #[test]
    fn a_long_sweep_spaces_out_the_next_ones() {
        use std::time::Duration;
        let every = Duration::from_millis(250);
        assert_eq!(sweep_pause(Duration::from_millis(1), every, 20), every);
        assert_eq!(sweep_pause(Duration::ZERO, every, 20), every);
        assert_eq!(
            sweep_pause(Duration::from_millis(100), every, 20),
            Duration::from_secs(2)
        );
        assert_eq!(
            sweep_pause(Duration::MAX, every, 20),
            SWEEP_PAUSE_MAX,
            "no overflow, and at most a minute"
        );
    }

    #[test]
    fn waits_stop_at_the_deadline_or_just_after_the_next_expiry() {
        assert_eq!(wait_ms(0, 5_000_000, None, 1000), 1000);
        assert_eq!(wait_ms(0, 300_000, None, 1000), 300);
        assert_eq!(wait_ms(0, 5_000_000, Some(200_000), 1000), 201);
        assert_eq!(wait_ms(0, 100_000, Some(200_000), 1000), 100);
        assert_eq!(wait_ms(10, 5, None, 1000), 0);
        assert_eq!(wait_ms(0, 1, None, 1000), 1);
    }

    #[test]
    fn capacity_returns_when_enough_units_age_out() {
        // Ended at 10 (weight 1) and 30 (weight 9), a lapsed lease at 20 (weight 2):
        // 12 ended units.
        let ended = [(10, 1), (30, 9)];
        let lapsed = [(20, 2)];
        let at = |need| capacity(need, 12, |_| (ended.to_vec(), false), &lapsed);
        let c = |how, at| Capacity { how, at };
        assert_eq!(at(1), c(AgeOut::Oldest, Some(10)));
        assert_eq!(at(0), c(AgeOut::Oldest, Some(10)), "the oldest");
        assert_eq!(at(3), c(AgeOut::Enough, Some(20)));
        assert_eq!(at(4), c(AgeOut::Enough, Some(30)));
        assert_eq!(at(12), c(AgeOut::Enough, Some(30)));
        // More than the ended units: the rest is active, nothing is read.
        assert_eq!(at(13), c(AgeOut::TooFew, None));
        let unread = |_| -> (Vec<(i64, i64)>, bool) { unreachable!("read where it cannot help") };
        assert_eq!(capacity(13, 12, unread, &lapsed), c(AgeOut::TooFew, None));
        assert_eq!(capacity(1, 0, unread, &lapsed), c(AgeOut::NoneEnded, None));
        assert_eq!(
            capacity(1, 2, |_| ([].to_vec(), false), &lapsed),
            c(AgeOut::Oldest, Some(20))
        );
        assert_eq!(
            capacity(1, 0, |_| ([].to_vec(), false), &[]),
            c(AgeOut::NoneEnded, None)
        );
        assert_eq!(
            capacity(3, 0, |_| (ended.to_vec(), false), &[]),
            c(AgeOut::NoneEnded, None)
        );
        // Reading stopped before enough: beyond what a refusal reads, even where a
        // later lapsed lease would make up the units (unread tickets ended before it).
        assert_eq!(
            capacity(3, 50, |_| ([(1, 1), (2, 1)].to_vec(), true), &[(9, 5)]),
            c(AgeOut::Beyond, None)
        );
        assert_eq!(
            capacity(2, 50, |_| ([(1, 1), (5, 1)].to_vec(), true), &[(3, 5)]),
            c(AgeOut::Enough, Some(3))
        );
        // Reading stopped before enough: beyond what a refusal reads.
        assert_eq!(
            capacity(5, 50, |_| ([(1, 1), (2, 1)].to_vec(), true), &[]),
            c(AgeOut::Beyond, None)
        );
        // Counts that disagree with the tickets read (a summary rebuilt since): too few.
        assert_eq!(
            capacity(5, 50, |_| ([(1, 1), (2, 1)].to_vec(), false), &[]),
            c(AgeOut::TooFew, None)
        );
        // Equal instants: either order frees the same units by then.
        assert_eq!(
            capacity(3, 3, |_| ([(5, 1)].to_vec(), false), &[(5, 2)]),
            c(AgeOut::Enough, Some(5))
        );
        assert_eq!(
            c(AgeOut::Oldest, Some(5)).after(2),
            c(AgeOut::Oldest, Some(2_000_005))
        );
    }

    #[test]
    fn lapsed_tickets_age_out_by_their_expiry() {
        // Units for the active count and for the retained one (0.7.0).
        let l = Lapsed::new(vec![(30, 1), (10, 4), (20, 1)]);
        assert_eq!(l.expired(), 6);
        assert_eq!(l.aged_out(20), 4);
        assert_eq!(l.aged_out(21), 5);
        assert_eq!(l.aged_out(i64::MIN), 0);
        assert_eq!(l.retained_from(15), &[(20, 1), (30, 1)]);
        assert!(l.retained_from(31).is_empty());
        assert_eq!(Lapsed::default().expired(), 0);
        assert_eq!(earliest(Some(3), Some(2)), Some(2));
        assert_eq!(earliest(None, Some(2)), Some(2));
        assert_eq!(earliest(None, None), None);
    }

    #[test]
    fn waits_count_months_as_30_days_and_saturate() {
        assert_eq!(wait_micros(0, 0, 1_500_000), Some(1_500_000));
        assert_eq!(wait_micros(1, 1, 0), Some(31 * 86_400_000_000));
        assert_eq!(wait_micros(0, 0, -1), None);
        assert_eq!(wait_micros(0, 1, -3_600_000_000), Some(23 * 3_600_000_000));
        assert_eq!(wait_micros(i32::MAX, i32::MAX, i64::MAX), Some(i64::MAX));
    }

    proptest! {
        /// Active and "ended at or after the cutoff" partition the retained tickets.
        #[test]
        fn retained_is_active_or_ended_recently(
            ended in proptest::option::of(0i64..100),
            lease in proptest::option::of(0i64..100),
            now in 0i64..200,
            ret in 0i64..100,
        ) {
            let cutoff = now - ret;
            let end = effective_end(ended, lease, now);
            prop_assert_eq!(is_retained(ended, lease, now, cutoff),
                is_active(ended, lease, now) || end.is_some_and(|e| e >= cutoff));
            // Time only ever ends tickets.
            if !is_active(ended, lease, now) {
                prop_assert!(!is_active(ended, lease, now + 1));
            }
        }
    }
}
