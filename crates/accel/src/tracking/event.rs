//! The subset of TensorFlow's `Event` protobuf that scalar logging needs, as prost messages.
//!
//! Field numbers follow `tensorflow/core/util/event.proto` and `tensorflow/core/framework/summary.proto` (the same
//! files TensorBoard vendors under `tensorboard/compat/proto/`):
//!
//! ```text
//! message Event   { double wall_time = 1; int64 step = 2;
//!                   oneof what { string file_version = 3; bytes graph_def = 4; Summary summary = 5; ... } }
//! message Summary { repeated Value value = 1;
//!                   message Value { string node_name = 7; string tag = 1; SummaryMetadata metadata = 9;
//!                                   oneof value { float simple_value = 2; ... } } }
//! ```
//!
//! TensorBoard's data-compat layer turns a `simple_value` into a scalar of the scalars plugin, so no metadata is
//! needed.

/// Version string of the first event of every file (`brain.Event:2`, what TensorFlow and tensorboardX write).
pub const FILE_VERSION: &str = "brain.Event:2";

/// `tensorflow.Event`: one record of an event file.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    /// Seconds since the Unix epoch.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// Global step of the event.
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// The payload.
    #[prost(oneof = "EventWhat", tags = "3, 5")]
    pub what: Option<EventWhat>,
}

/// `Event.what`: the payloads accel writes.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum EventWhat {
    /// First event of a file: `brain.Event:2`.
    #[prost(string, tag = "3")]
    FileVersion(String),
    /// Scalar values.
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    /// The values of this summary.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` with a `simple_value` (a scalar, stored as f32).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    /// Name of the series, e.g. `train/loss`.
    #[prost(string, tag = "1")]
    pub tag: String,
    /// The payload (a `oneof` in TensorFlow's proto, so a 0.0 scalar is still written: proto3 would drop a plain
    /// zero field and TensorBoard would then see no value at all).
    #[prost(oneof = "SummaryValueKind", tags = "2")]
    pub value: Option<SummaryValueKind>,
}

/// `Summary.Value.value`: the kinds accel writes.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum SummaryValueKind {
    /// A scalar.
    #[prost(float, tag = "2")]
    SimpleValue(f32),
}

impl Event {
    /// The `file_version` event every event file starts with.
    pub fn file_version(wall_time: f64) -> Self {
        Event { wall_time, step: 0, what: Some(EventWhat::FileVersion(FILE_VERSION.to_string())) }
    }

    /// An event with one scalar per `(tag, value)`; values are rounded to f32 as TensorBoard stores them.
    pub fn scalars(wall_time: f64, step: i64, values: &[(&str, f64)]) -> Self {
        let value = values
            .iter()
            .map(|(tag, v)| SummaryValue {
                tag: tag.to_string(),
                value: Some(SummaryValueKind::SimpleValue(*v as f32)),
            })
            .collect();
        Event { wall_time, step, what: Some(EventWhat::Summary(Summary { value })) }
    }
}
