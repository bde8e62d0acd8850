//! The link of the single-process kinds: one rank, nothing to exchange.

use std::time::Duration;

use super::{Link, Op, Round, Seat, Ticket};
use crate::comm::fingerprint::Fingerprint;
use crate::host::HostData;
use crate::{Error, Result};

/// One rank alone. Values pass through unchanged; a collective of one rank gives its own
/// buffer back.
#[derive(Default)]
pub(crate) struct Solo;

impl Link for Solo {
    fn seat(&self) -> Seat {
        Seat {
            rank: 0,
            size: 1,
            local_rank: 0,
            hosts: 1,
            check: true,
            // One rank alone never waits.
            timeout: Duration::ZERO,
        }
    }

    fn next_store_id(&self) -> u64 {
        0
    }

    fn shut(&self, _why: String) {}

    fn begin(&self, _fp: &Fingerprint) -> Result<Box<dyn Round + '_>> {
        Ok(Box::new(SoloRound { landed: Vec::new() }))
    }
}

/// A round of one rank: every collective's result is this rank's own buffer.
struct SoloRound {
    landed: Vec<Option<(HostData, HostData)>>,
}

impl Round for SoloRound {
    /// One rank is never out of step with others: nothing to shut.
    fn shut_link(&mut self, _why: String) {}

    fn seq(&self) -> u64 {
        0
    }

    fn start(&mut self, op: Op, send: HostData, recv: HostData) -> Result<Ticket> {
        let done = match op {
            Op::Reduce { .. } | Op::ReduceScatter | Op::AllGather | Op::AllToAll => {
                let empty = HostData::filled(send.dtype(), 0, 0.0);
                drop(recv);
                (empty, send)
            }
            Op::Broadcast { .. } | Op::Scatter { .. } => (recv, send),
        };
        self.landed.push(Some(done));
        Ok(Ticket(self.landed.len() - 1))
    }

    fn start_all_to_all_v(
        &mut self,
        send: HostData,
        _lens: &[usize],
        recv: HostData,
    ) -> Result<Ticket> {
        self.start(Op::AllToAll, send, recv)
    }

    fn land(&mut self, ticket: Ticket) -> Result<(HostData, HostData)> {
        (self.landed.get_mut(ticket.0).and_then(Option::take))
            .ok_or_else(|| Error::internal("a collective landed twice"))
    }

    fn all_gather_words(&mut self, mine: &[u64]) -> Result<Vec<u64>> {
        Ok(mine.to_vec())
    }
}
