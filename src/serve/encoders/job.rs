//! The one door of the encoders' APIs: a [`Job`] of any kind (embed, rerank, tower) is made
//! ready off the async threads (its texts tokenized, its images decoded, its tensors built;
//! stopped when its client goes away), each of its runs placed through the lifecycle, and its
//! answer read from what they gave, with where the last of them ran ([`Done`]).

use tokio::time::Instant;

use crate::core::backend::RunMeta;
use crate::core::snapshot::Action;
use crate::core::tensor::Tensor;
use crate::serve::batching::Batchers;
use crate::serve::lifecycle::{self, Refused};
use crate::serve::metrics::Outcome;
use crate::serve::ran::RanOn;
use crate::serve::service::Service;

/// A request of one kind of encoder, as its API asked it, checked against its model: what it
/// does before it runs, the runs it asks for, and what it makes of their outputs.
pub trait Job: Send + 'static {
    /// What it keeps from [`Job::prepare`] for [`Job::answer`] (each input's tokens, its
    /// texts).
    type Ready: Send + 'static;
    /// What it answers: plain values (vectors, scores, the tokens it read).
    type Answer;

    /// The model the request named: it is counted under it, and its answer says it.
    fn model(&self) -> &str;

    /// Its CPU work before it runs (tokenizing, decoding and preprocessing images, building
    /// its tensors), on a blocking thread: the runs it asks for, in order, and what it keeps.
    /// Stops with any error when `gone` says its client went away.
    fn prepare(self, gone: &dyn Fn() -> bool) -> Result<(Self::Ready, Vec<Run>), Invalid>;

    /// Its answer from the output each run gave, in the runs' order.
    fn answer(ready: Self::Ready, outputs: Vec<Tensor>) -> Result<Self::Answer, Failure>;
}

/// One run a job asks for: through the lifecycle on its model, reading one output back.
#[derive(Debug)]
pub struct Run {
    /// The model it runs on (a dual encoder's image tower may not be the model named).
    pub model: String,
    /// Its inputs, the batch axis one row per input.
    pub inputs: Vec<Tensor>,
    /// The output to read.
    pub output: &'static str,
    /// Its rows are right-padded with an attention mask at 0 over the padding, so they may
    /// share a run with other requests' rows of other lengths (`models[].batching`); without
    /// it, it runs alone.
    pub pads: bool,
}

/// What a job answered, and where it ran.
#[derive(Debug)]
pub struct Done<A> {
    /// Its answer.
    pub answer: A,
    /// The decision that placed its last run: admit, redirect or shrink_context.
    pub action: Action,
    /// Where its last run ran, as its client is told.
    pub ran: RanOn,
}

/// A request's input that its model cannot take: the message, and the field at fault.
#[derive(Debug, Clone, PartialEq)]
pub struct Invalid {
    /// What is wrong, naming the input.
    pub message: String,
    /// The request's field at fault (`input`, `documents`), when one is.
    pub field: Option<&'static str>,
}

impl Invalid {
    /// `message`, about `field`.
    pub fn new(message: impl Into<String>, field: Option<&'static str>) -> Invalid {
        Invalid {
            message: message.into(),
            field,
        }
    }
}

/// Why a job was not answered.
pub enum Failure {
    /// Its input is wrong for its model: the client's mistake.
    Invalid(Invalid),
    /// The lifecycle refused or failed a run of it (boxed: it is large, and rare).
    Refused(Box<Refused>),
    /// A fault of ours (a run gave an output of the wrong shape), whose detail is for the log.
    Internal(String),
}

/// The one output of a job of one run, or the fault of ours that it is not.
pub(super) fn only_output(outputs: &[Tensor]) -> Result<&Tensor, Failure> {
    match outputs {
        [output] => Ok(output),
        _ => Err(Failure::Internal(format!("{} outputs for one run", outputs.len()))),
    }
}

impl From<Invalid> for Failure {
    fn from(invalid: Invalid) -> Failure {
        Failure::Invalid(invalid)
    }
}

/// Run `job`, the request with the identity and limits `meta` and arrived at `received`:
/// prepare it ([`Job::prepare`]), place each of its runs through the lifecycle in order
/// (through `batching` when its rows pad; none after one is refused), and answer from their
/// outputs. A job refused while it is prepared is counted here, and one whose client goes away
/// then is counted `cancelled`; its runs are counted by the lifecycle. A model's fallback never
/// answers a run: its inputs were made for this model's tokenizer and preprocessing, and its
/// vectors or scores would not be comparable with this one's.
pub async fn run<J: Job>(
    service: &Service,
    batching: &Batchers,
    job: J,
    meta: RunMeta,
    received: Instant,
) -> Result<Done<J::Answer>, Failure> {
    let model = job.model().to_string();
    let (ready, runs) = prepare(service, job, &model, received).await?;
    let mut outputs = Vec::with_capacity(runs.len());
    let mut last = None;
    for run in runs {
        let request = lifecycle::Request {
            meta: meta.clone(),
            model: run.model,
            inputs: run.inputs,
            outputs: vec![run.output.to_string()],
            max_new_tokens: 0,
            received,
            shrinker: None,
            progress: Default::default(),
            allow_substitute: false,
            sequence: None,
            generations: 0,
            pads: run.pads,
        };
        let mut served = match run.pads {
            true => batching.infer(request).await,
            false => lifecycle::infer(service, request).await,
        }
        .map_err(|refused| Failure::Refused(Box::new(refused)))?;
        let at = (served.outputs.iter().position(|t| t.name == run.output))
            .ok_or_else(|| Failure::Internal(format!("the run gave no `{}`", run.output)))?;
        outputs.push(served.outputs.swap_remove(at));
        last = Some(served);
    }
    let served = last.ok_or_else(|| Failure::Internal("the request asked for no run".into()))?;
    Ok(Done {
        answer: J::answer(ready, outputs)?,
        action: served.action,
        ran: service.ran_on(&served.pool, &model),
    })
}

/// [`Job::prepare`] off the async threads
/// ([`until_dropped`](crate::core::blocking::until_dropped)), counted when it refuses the
/// request or its client goes away.
async fn prepare<J: Job>(
    service: &Service,
    job: J,
    model: &str,
    received: Instant,
) -> Result<(J::Ready, Vec<Run>), Failure> {
    let mut preparing = Preparing {
        service,
        model,
        received,
        armed: true,
    };
    let prepared = crate::core::blocking::until_dropped(move |gone| job.prepare(gone)).await;
    preparing.armed = false;
    let failure = match prepared {
        Ok(Ok(prepared)) => return Ok(prepared),
        Ok(Err(invalid)) => Failure::Invalid(invalid),
        Err(e) => {
            // `prepare` catches what a client's input can make it do: this is a fault of ours,
            // or a shutdown, whose detail is for the log.
            tracing::error!(error = %e, "reading a request did not finish");
            Failure::Internal("reading the request failed".into())
        }
    };
    let outcome = match failure {
        Failure::Invalid(_) => Outcome::client_error,
        _ => Outcome::failed,
    };
    lifecycle::answered(service, model, outcome, received);
    Err(failure)
}

/// A job being prepared, counted `cancelled` when its future is dropped then (its client went
/// away), as [`lifecycle::Counted`] counts one dropped later.
struct Preparing<'a> {
    service: &'a Service,
    model: &'a str,
    received: Instant,
    /// Set until it is prepared.
    armed: bool,
}

impl Drop for Preparing<'_> {
    fn drop(&mut self) {
        if self.armed {
            lifecycle::answered(self.service, self.model, Outcome::cancelled, self.received);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;
    use crate::core::tensor::TensorData;
    use crate::testing::fakes::{self, Echo, FakeFactory};

    /// A job of two runs on `enc`, the first through its batcher, each of one row of `value`s,
    /// answered with each run's values; refused when prepared, or waiting for its client to go,
    /// as `ends` says.
    struct Twice {
        ends: Ends,
    }

    enum Ends {
        Runs,
        Refused,
        /// Says on the channel when it saw its client go.
        WhenGone(mpsc::Sender<()>),
    }

    impl Job for Twice {
        type Ready = ();
        type Answer = Vec<Vec<f32>>;

        fn model(&self) -> &str {
            "enc"
        }

        fn prepare(self, gone: &dyn Fn() -> bool) -> Result<((), Vec<Run>), Invalid> {
            match self.ends {
                Ends::Runs => {}
                Ends::Refused => return Err(Invalid::new("`input[0]` is wrong", Some("input"))),
                Ends::WhenGone(seen) => {
                    while !gone() {
                        std::thread::yield_now();
                    }
                    seen.send(()).unwrap();
                    return Err(Invalid::new("the client went away", None));
                }
            }
            let run = |value: f32| Run {
                model: "enc".into(),
                inputs: vec![Tensor {
                    name: "input".into(),
                    shape: vec![1, 1, 4],
                    data: TensorData::Fp32(vec![value; 4]),
                }],
                output: "input",
                pads: value == 1.0,
            };
            Ok(((), vec![run(1.0), run(2.0)]))
        }

        fn answer((): (), outputs: Vec<Tensor>) -> Result<Vec<Vec<f32>>, Failure> {
            Ok(outputs
                .into_iter()
                .map(|t| match t.data {
                    TensorData::Fp32(values) => values,
                    other => panic!("echoed as {:?}", other.datatype()),
                })
                .collect())
        }
    }

    fn service() -> (Arc<Service>, Batchers, crate::testing::Scratch) {
        let script = crate::testing::Scratch::new();
        let yaml = format!(
            "models: [{{name: enc, path: 'builtin:encoder', batching: {{max_batch: 4, max_delay: 1ms}}}}]\n\
             pools: [{{name: cpu, provider: cpu, models: [enc]}}]\n{}",
            script.policy(crate::testing::ADMIT_ALL)
        );
        let factory = Arc::new(FakeFactory::new(|_| Ok(Box::new(Echo))));
        let service = Arc::new(fakes::service(crate::testing::config::validated(&yaml), factory));
        (Arc::clone(&service), Batchers::new(service), script)
    }

    /// `enc`'s requests counted with `outcome` on `pool`.
    fn counted(service: &Service, outcome: &str, pool: &str) -> String {
        let text = crate::telemetry::metrics::encode(&service.registry);
        let series = format!("vramguard_requests_total{{model=\"enc\",pool=\"{pool}\",outcome=\"{outcome}\"}} ");
        let value = text.lines().find_map(|l| l.strip_prefix(&series));
        value.unwrap_or("none").to_string()
    }

    #[tokio::test]
    async fn a_job_s_runs_go_in_order_and_it_answers_from_their_outputs_with_where_it_ran() {
        let (service, batching, _script) = service();
        let job = Twice { ends: Ends::Runs };
        let Ok(done) = run(&service, &batching, job, RunMeta::default(), Instant::now()).await else {
            panic!("not answered");
        };
        assert_eq!(done.answer, [vec![1.0; 4], vec![2.0; 4]]);
        assert_eq!((done.ran.pool.as_str(), done.action), ("cpu", Action::Admit));
        assert_eq!(counted(&service, "ok", "cpu"), "2", "each run is counted");
    }

    #[tokio::test]
    async fn a_job_refused_or_left_while_prepared_is_counted_under_its_model() {
        let (service, batching, _script) = service();
        let refused = run(
            &service,
            &batching,
            Twice { ends: Ends::Refused },
            RunMeta::default(),
            Instant::now(),
        );
        match refused.await {
            Err(Failure::Invalid(invalid)) => assert_eq!(invalid, Invalid::new("`input[0]` is wrong", Some("input"))),
            _ => panic!("not refused as invalid"),
        }
        assert_eq!(counted(&service, "client_error", ""), "1");

        let (seen, saw) = mpsc::channel();
        let left = Twice {
            ends: Ends::WhenGone(seen),
        };
        // Polled once, then dropped: its client went away while it was prepared.
        let dropped = tokio::time::timeout(
            Duration::ZERO,
            run(&service, &batching, left, RunMeta::default(), Instant::now()),
        );
        assert!(dropped.await.is_err());
        assert_eq!(counted(&service, "cancelled", ""), "1");
        saw.recv().expect("the job saw its client go");
    }
}
