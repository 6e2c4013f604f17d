//! A batch of requests placed and run as one: the batcher (`serve::batching`) merges its
//! members into one request, which is admitted like any other (the policy asked once, seeing
//! the batch's rows as `req.batch` and the batch's estimate), and runs once. A run that fails
//! in a way the pool's fallback would not share (an allocator failure) is not retried as a
//! batch: each member runs alone there through the one retry ([`after_failure`]), when it
//! may be replayed; the others get the error. Alone, each is the request it would have been
//! without the batch, and the retry's counts and what its client is told are the ones a request
//! of its own gets.

use std::sync::Arc;

use futures_util::future::join_all;

use crate::core::snapshot::Action;
use crate::pool::Inputs;
use crate::serve::service::Service;

use super::place::{placed, release_hold};
use super::retry::{Run, after_failure};
use super::run::run_permitted;
use super::{Ran, Refused, Request, Served};

/// What became of a placed batch.
#[derive(Debug)]
pub enum BatchRan {
    /// It ran as one: its outputs, from which each member's rows are cut.
    Together(Served),
    /// Its run failed: each member's own answer (in the members' order) after running alone
    /// on the pool's fallback, or the error when it could not.
    Apart(Vec<Result<Served, Refused>>),
}

/// Place and run `batch`, the merged request of `members` (each with its own inputs, meta and
/// progress). A refusal before the run (the policy's, a deadline, the host's reserve) is the
/// whole batch's.
pub async fn place_batch(service: &Service, mut batch: Request, members: &[Request]) -> Result<BatchRan, Refused> {
    let (mut admitted, estimate_bytes) = placed(service, &mut batch).await?;
    let pool = Arc::clone(&admitted.pool);
    let inputs = Inputs::from(std::mem::take(&mut batch.inputs));
    let ran = run_permitted(service, &pool, &batch, inputs, estimate_bytes).await;
    release_hold(service, &mut admitted);
    let error = match ran {
        Ok(outputs) => {
            return Ok(BatchRan::Together(Served {
                pool,
                action: admitted.action,
                context: None,
                context_cut: None,
                retry_started: None,
                retried: None,
                outputs,
            }));
        }
        Err(error) => error,
    };
    let entry = service.model(&batch.model).expect("placed checked the model");
    let alone = members.iter().map(|member| {
        let error = error.clone();
        let pool = Arc::clone(&pool);
        async move {
            let need = entry.estimate_inputs(&member.inputs);
            let need = need.context_bytes.saturating_add(need.workspace_bytes);
            let spare = member.meta.replayable.then(|| Inputs::from(member.inputs.clone()));
            let ran = after_failure(service, &pool, member, error, spare, need, Run::Placed).await?;
            Ok(served_alone(member, ran))
        }
    });
    Ok(BatchRan::Apart(join_all(alone).await))
}

/// A member's answer from its run alone on the fallback.
fn served_alone(member: &Request, ran: Ran) -> Served {
    let retry_started = member
        .progress
        .last_started()
        .map(|at| at.saturating_duration_since(member.received.into_std()));
    Served {
        pool: ran.pool,
        action: Action::Redirect,
        context: None,
        context_cut: None,
        retry_started,
        retried: ran.retried,
        outputs: ran.outputs,
    }
}
